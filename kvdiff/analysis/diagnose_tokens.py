"""tokenization_mismatch, sampling_mismatch, logits_mismatch, numerical_noise (all within tolerance, or a benign near-tie)
and non_finite."""

from __future__ import annotations

import numpy as np

from kvdiff.analysis.diagnosis import Diagnosis, DiagnosisInputs, fmt
from kvdiff.analysis.compare import Comparison
from kvdiff.analysis.search import Location, all_maps
from kvdiff.analysis.storage import same_rows
from kvdiff.analysis.tolerance import Tier


def diagnose_tokenization(inputs: DiagnosisInputs) -> list[Diagnosis]:
    i = inputs.comparison.alignment.first_input_difference
    if i is None:
        return []
    a, b = inputs.reference.meta.input_ids, inputs.candidate.meta.input_ids
    n = min(a.size, b.size)
    differing = np.flatnonzero(a[:n] != b[:n])
    last = int(differing[-1]) if differing.size else n - 1
    show = lambda ids, j: repr(inputs.token_text(int(ids[j]))) + f" (id {int(ids[j])})" if j < ids.size else "nothing"
    evidence = (f"input ids differ from position {i}: reference {show(a, i)}, candidate {show(b, i)}; "
                f"{differing.size} of {n} shared positions differ, lengths {a.size} vs {b.size}; "
                f"every position from {i} on has different inputs and is not compared")
    return [Diagnosis("tokenization_mismatch", inputs.chunks.chunk_of(i), (i, max(i, last)), evidence, {
        "reference_token": inputs.token_text(int(a[i])) if i < a.size else None,
        "candidate_token": inputs.token_text(int(b[i])) if i < b.size else None}, confidence=1.0,
        proof=f"input id at position {i}: {int(a[i]) if i < a.size else 'none'} (reference) vs "
              f"{int(b[i]) if i < b.size else 'none'} (candidate)")]


def diagnose_sampling(inputs: DiagnosisInputs) -> list[Diagnosis]:
    """sampling_mismatch: at the first token flip the candidate's token is not the top-1 of its own
    logits there (its recorded top-k): it chose its tokens otherwise than by the greedy argmax both
    runs are meant to use (sampling, a penalty, another logits processor)."""
    td = inputs.comparison.alignment.first_token_divergence
    if td is None or td.candidate_token is None:
        return []
    steps = inputs.candidate.steps
    if steps.topk_ids.ndim != 2 or not steps.topk_ids.shape[1]:
        return []
    at = np.flatnonzero(steps.step == td.step)
    own_top = steps.topk_ids[:, 0]
    if not at.size or steps.token_id[at[0]] == own_top[at[0]]:
        return []
    i = at[0]
    if not np.isfinite(steps.topk_values[i]).all():
        return []           # no argmax of NaN logits: non_finite's finding, not a sampling rule
    chosen, top = int(steps.token_id[i]), int(own_top[i])
    ranked = [int(t) for t in steps.topk_ids[i]]
    if chosen in ranked and steps.topk_values[i][ranked.index(chosen)] == steps.topk_values[i][0]:
        return []           # a tie for the top: either is the argmax
    others = int((steps.token_id != own_top).sum())
    rank = f"its rank {ranked.index(chosen) + 1} of the top {len(ranked)}" if chosen in ranked else \
        f"outside its top {len(ranked)}"
    tok = lambda t: f"{inputs.token_text(t)!r} (id {t})"
    evidence = (f"step {td.step} (position {td.position}): the candidate chose {tok(chosen)}, but its own logits there "
                f"put {tok(top)} first ({rank}, top-1 margin {fmt(float(steps.margin[i]))}): it did not take the "
                f"greedy argmax of its logits (sampling, a penalty or another logits processor), at {others} of its "
                f"{steps.token_id.size} steps")
    return [Diagnosis("sampling_mismatch", inputs.chunks.chunk_of(td.position), (td.position, td.position), evidence,
                      {"step": td.step, "chosen_token": inputs.token_text(chosen), "own_top_token": inputs.token_text(top),
                       "steps_not_argmax": others}, confidence=1.0,
                      proof=f"the candidate's recorded step {td.step}: token id {chosen}, its own top-1 id {top}")]


def diagnose_logits(inputs: DiagnosisInputs, whole: Comparison) -> list[Diagnosis]:
    """logits_mismatch: at the first token flip both runs took the greedy argmax of their own logits,
    by a margin no rounding of the LM head makes up (1e-3 of the largest logit), yet the candidate's
    final-norm row at that position equals the reference's bitwise or within rounding noise, or the
    candidate computed no row there at all: the
    logits it chose from were not computed from that row (another row's logits taken, logits kept
    from an earlier forward, or the LM head differs). `whole`: the comparison of every row (a digest
    trace's digests too), not only the zoom window's."""
    td, al = whole.alignment.first_token_divergence, whole.alignment
    if td is None or td.candidate_token is None or td.reference_token is None:
        return []
    own = []
    for steps in (inputs.reference.steps, inputs.candidate.steps):
        at = np.flatnonzero(steps.step == td.step)
        if not at.size or steps.topk_ids.ndim != 2 or not steps.topk_ids.shape[1] or \
                steps.token_id[at[0]] != steps.topk_ids[at[0], 0]:
            return []           # no top-k, or a token that is not its own argmax: sampling_mismatch's
        own.append((float(steps.margin[at[0]]), float(np.abs(steps.topk_values[at[0]]).max())))
    (margin, top), col = own[0], np.flatnonzero(al.positions == td.position)
    if not np.isfinite(margin) or margin <= max(1e-4, 1e-3 * top):
        return []
    final_norm = whole.final.get("final_norm")
    if col.size and al.computed[col[0]]:
        tier = None if final_norm is None else int(final_norm.tier[0, col[0]])
        if tier not in (Tier.BITWISE, Tier.NOISE):
            return []
        where = (f"its final-norm row at position {td.position} equals the reference's "
                 + ("bitwise" if tier == Tier.BITWISE else
                    f"within rounding noise (rel {fmt(float(final_norm.rel[0, col[0]]))}), far less than moves a margin "
                    f"of {fmt(margin)}"))
    else:
        where = f"it computed no row at position {td.position} (the request's last prompt token came from its cache)"
    evidence = (f"step {td.step} (position {td.position}): both runs took the greedy argmax of their own logits, "
                f"{td.reference_token!r} (reference, margin {fmt(margin)}) and {td.candidate_token!r} (candidate), yet "
                f"{where}: the logits the candidate chose from were not computed from that row (another row's logits "
                f"taken, logits kept from an earlier forward, or the LM head differs)")
    return [Diagnosis("logits_mismatch", inputs.chunks.chunk_of(td.position), (td.position, td.position), evidence,
                      {"step": td.step, "computed_row": bool(col.size and al.computed[col[0]])}, confidence=1.0,
                      proof=f"final_norm at position {td.position}: "
                            f"{'within tolerance' if col.size and al.computed[col[0]] else 'no candidate row'}; both "
                            f"recorded steps' tokens are their own top-1; the reference's top-1/top-2 margin "
                            f"{fmt(margin)} exceeds 1e-3 of its largest logit")]


def _near_tie(inputs: DiagnosisInputs, first_divergence: Location | None) -> Diagnosis | None:
    td = inputs.comparison.alignment.first_token_divergence
    if td is None or first_divergence is not None or td.reference_margin is None:
        return None
    logits = inputs.comparison.final.get("logits")
    tol = inputs.comparison.tolerances.for_point("logits")
    steps = inputs.reference.steps
    top = np.abs(steps.topk_values[steps.step == td.step]).max(initial=0.0)
    threshold = 2 * tol.bound(float(top))
    margins = [m for m in (td.reference_margin, td.candidate_margin) if m is not None]
    if min(margins) > threshold:
        return None
    col = np.flatnonzero(inputs.comparison.alignment.positions == td.position)
    diff = f", logits max_abs there {fmt(float(logits.max_abs[0, col[0]]))}" if logits is not None and col.size else ""
    evidence = (f"step {td.step}: tokens {td.reference_token!r} vs {td.candidate_token!r} flip on a near-tie: top-1/top-2 "
                f"margins {fmt(td.reference_margin)} (reference) and "
                f"{'n/a' if td.candidate_margin is None else fmt(td.candidate_margin)} (candidate) are within "
                f"{fmt(threshold)}, twice the logits tolerance{diff}; every earlier tensor is within tolerance")
    return Diagnosis("numerical_noise", inputs.chunks.chunk_of(td.position), (td.position, td.position), evidence,
                     {"step": td.step, "near_tie_threshold": threshold}, confidence=1.0,
                     proof=f"no tensor breaks tolerance before the flip; smallest top-1/top-2 margin "
                           f"{fmt(min(margins))} <= {fmt(threshold)}")


def diagnose_step_logits(inputs: DiagnosisInputs, whole: Comparison) -> list[Diagnosis]:
    """logits_mismatch where the traces hold no logits per position (an engine that projects only the
    rows it samples): at the first step both runs took the same tokens up to, whose recorded top-1
    logit differs beyond the logits tolerance while the final-norm row there matches, the logits the
    candidate sampled from were made otherwise from that row (a logits processor on one side, a
    soft-cap left on). `whole`: the comparison of every row (a digest trace's digests too)."""
    if "logits" in whole.final:
        return []
    ref, cand = inputs.reference.steps, inputs.candidate.steps
    n = min(ref.step.size, cand.step.size)
    if not n or ref.topk_values.ndim != 2 or cand.topk_values.ndim != 2:
        return []
    same = np.cumprod(ref.token_id[:n] == cand.token_id[:n]).astype(bool)
    a, b = ref.topk_values[:n, 0].astype(np.float64), cand.topk_values[:n, 0].astype(np.float64)
    tolerance = whole.tolerances.for_point("logits")
    with np.errstate(invalid="ignore"):
        differ = same & np.isfinite(a) & np.isfinite(b) & (np.abs(a - b) > tolerance.bound(np.maximum(np.abs(a), np.abs(b))))
    if not differ.any():
        return []
    i = int(np.flatnonzero(differ)[0])
    position = int(cand.position[i])
    final_norm, al = whole.final.get("final_norm"), whole.alignment
    col = np.flatnonzero(al.positions == position)
    if final_norm is None or not col.size or int(final_norm.tier[0, col[0]]) not in (Tier.BITWISE, Tier.NOISE):
        return []       # the row the logits come from differs already (or is not known to match): not after it
    evidence = (f"step {int(cand.step[i])} (position {position}): the runs chose the same tokens so far, but the "
                f"logits row the candidate sampled from has top-1 {fmt(float(b[i]))} where the reference's has "
                f"{fmt(float(a[i]))} ({int(differ.sum())} of {n} steps differ beyond the logits tolerance), while its "
                f"final-norm row there matches the reference's: the logits were made otherwise from that row (the LM "
                f"head, a soft-cap or another logits processor on one side)")
    return [Diagnosis("logits_mismatch", inputs.chunks.chunk_of(position), (position, position), evidence,
                      {"step": int(cand.step[i]), "from_steps": True, "reference_top_logit": float(a[i]),
                       "candidate_top_logit": float(b[i])}, confidence=1.0,
                      proof=f"recorded step {int(cand.step[i])}: top-1 logit {fmt(float(a[i]))} (reference) vs "
                            f"{fmt(float(b[i]))} (candidate), the same tokens chosen up to it")]


def diagnose_noise(inputs: DiagnosisInputs, first_bit: Location | None, first_divergence: Location | None) -> list[Diagnosis]:
    tie = _near_tie(inputs, first_divergence)
    if tie is not None:
        return [tie]
    if first_bit is None or first_divergence is not None or not inputs.comparison.alignment.tokens_identical:
        return []
    maps = all_maps(inputs.comparison)
    noisy = sum(int((m.tier == Tier.NOISE).sum()) for m in maps)
    compared = sum(int(((m.tier == Tier.NOISE) | (m.tier == Tier.BITWISE)).sum()) for m in maps)
    worst = max(maps, key=lambda m: np.nanmax(np.where(m.tier == Tier.NOISE, m.rel, -1.0)))
    r, c = np.unravel_index(np.nanargmax(np.where(worst.tier == Tier.NOISE, worst.rel, -1.0)), worst.rel.shape)
    where = "final" if worst.layers[r] is None else f"layer {worst.layers[r]}"
    evidence = (f"all {compared} compared rows are within tolerance and the tokens are identical; {noisy} differ in "
                f"their bits, first at {'final' if first_bit.layer is None else f'layer {first_bit.layer}'} position "
                f"{first_bit.position} {first_bit.tensor}; largest rel {fmt(float(worst.rel[r, c]))} at {where} "
                f"position {int(worst.positions[c])} {worst.point}")
    return [Diagnosis("numerical_noise", first_bit.chunk, (first_bit.position, int(inputs.comparison.alignment.positions[-1])),
                      evidence, {}, confidence=1.0,
                      proof=f"{compared} of {compared} compared rows within tolerance, tokens identical")]


def diagnose_non_finite(inputs: DiagnosisInputs, first: Location | None) -> list[Diagnosis]:
    if first is None:
        return []
    pmap = (inputs.comparison.final if first.layer is None else inputs.comparison.points)[first.tensor]
    row, col = pmap.layers.index(first.layer), int(np.flatnonzero(pmap.positions == first.position)[0])
    who = [name for name, ok in (("reference", pmap.ref_finite[row, col]), ("candidate", pmap.cand_finite[row, col])) if not ok]
    where = "final" if first.layer is None else f"layer {first.layer}"
    evidence = f"NaN or Inf first appears at {where} position {first.position} {first.tensor} in the {' and '.join(who)}"
    return [Diagnosis("non_finite", first.chunk, (first.position, first.position), evidence,
                      {"layer": first.layer, "tensor": first.tensor, "traces": who}, confidence=1.0,
                      proof=f"a non-finite value in the {' and '.join(who)}'s {first.tensor} row at {where} position "
                            f"{first.position}")]


EMBEDDED_ROWS = 64     # rows whose embedded token is looked up


def other_tokens_fed(inputs: DiagnosisInputs, cols: np.ndarray) -> Diagnosis | None:
    """tokenization_mismatch where both traces declare the same prompt but the candidate's engine
    embedded other tokens at the aligned columns `cols` (`_embedded_tokens`); else None."""
    tokens = _embedded_tokens(inputs, cols)
    if tokens is None:
        return None
    first, sequence, shift = tokens["positions"][0], inputs.sequence, tokens["shift"]
    how = {-1: f"; each holds the token of the position before it: a token doubled at {first}, the rest one "
               f"position late",
           1: f"; each holds the token of the next position: the token at {first} dropped"}.get(shift, "")
    evidence = (f"both traces declare the same prompt, but from position {first} the candidate's engine embedded other "
                f"tokens: its first layer's input rows are, exactly, the reference's rows of other tokens "
                f"({tokens['text']}){how}: it fed other token ids than the prompt's (a token doubled or dropped, a "
                f"boundary tokenized otherwise)")
    return Diagnosis("tokenization_mismatch", inputs.chunks.chunk_of(first), (first, tokens["positions"][-1]), evidence, {
        "reference_token": inputs.token_text(int(sequence[first])), "candidate_token": inputs.token_text(tokens["tokens"][0]),
        "declared_same": True, "embedded_tokens": tokens["tokens"], "token_shift": shift}, confidence=1.0,
        proof=f"resid_pre at layer 0 equals the reference's row of another token exactly at {len(tokens['positions'])} "
              f"positions from {first}")


def _whole_rows(inputs: DiagnosisInputs, found: list[tuple[int, int]]) -> bool:
    """Whether the candidate's first-layer keys at most found positions are the reference's keys of their
    source positions exactly, rotated there: whole rows of other positions, not other tokens fed here."""
    if "k" not in inputs.comparison.points:
        return False
    al = inputs.comparison.alignment
    column = {int(p): i for i, p in enumerate(al.positions)}
    ref, cand = inputs.rows(inputs.comparison.layers[0], "k")
    rows = [(column[p], column[q]) for p, q in found if p in column and q in column]
    # most, not all: a token repeated nearby may name another source than the row's own
    return bool(rows) and 2 * int(same_rows(cand[[p for p, _ in rows]], ref[[q for _, q in rows]]).sum()) >= len(rows)


def _embedded_tokens(inputs: DiagnosisInputs, cols: np.ndarray) -> dict | None:
    """Where the candidate's first-layer input rows at `cols` (up to EMBEDDED_ROWS) each equal exactly the
    reference's row at a position holding another token (an embedding depends on the token alone):
    {"positions", "tokens" (the ids embedded), "shift" (one offset back to the positions whose tokens
    they are, or None), "text"}; else None."""
    al, cols = inputs.comparison.alignment, cols[:EMBEDDED_ROWS]
    ref, cand = inputs.rows(inputs.comparison.layers[0], "resid_pre")
    sequence = inputs.sequence
    found = []
    for col in cols:
        same = np.flatnonzero(same_rows(ref, np.broadcast_to(cand[col], ref.shape)))
        src = [int(al.positions[j]) for j in same if al.positions[j] < sequence.size]
        position = int(al.positions[col])
        if not src or position >= sequence.size or sequence[src[0]] == sequence[position]:
            return None
        found.append((position, min(src, key=lambda q: abs(q - position))))
    if _whole_rows(inputs, found):
        return None         # rows of other positions labelled these: RoPE too was the source's, no token was fed
    shifts = {q - p for p, q in found}
    shown = ", ".join(f"{p} holds {inputs.token_text(int(sequence[q]))!r} (the token at {q})" for p, q in found[:4])
    return {"positions": [p for p, _ in found], "tokens": [int(sequence[q]) for _, q in found],
            "shift": shifts.pop() if len(shifts) == 1 else None,
            "text": shown + ("..." if len(found) > 4 else "")}

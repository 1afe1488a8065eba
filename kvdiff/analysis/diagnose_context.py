"""missing_context and attention_mismatch: the candidate's attention recomputed from its own q, k, v.

At the first layer where attention's output breaks tolerance at positions the candidate computed
(z, before o_proj, where both traces hold it; else attn_out), its attention is recomputed from its
own recorded q, k and v (at positions it read from a cache, k and v are the rows attention read)
under each hypothesis of `attention_fit`, and tested against the output it recorded. The
hypothesis that explains the rows (it leaves at most half of the change unexplained, and at most
half of what the next-best one leaves) names the cause:

- keys hidden (one span for every tested row, or each row's chunk alone): missing_context with
  exactly those positions, down to a single row;
- another softmax scale or soft-cap, a mask otherwise (the next position visible, not causal, a
  window, the row's own key hidden, offset), keys never written to the cache, K and V swapped, the
  KV heads tiled: attention_mismatch with that explanation;
- the reference's own causal attention: nothing where q, k or v differ (they explain the output);
  where they match, the reference's attention is the one that departs from the model's, and the
  same hypotheses are tested on its rows against its own z (attention_mismatch, `side` "reference":
  a cold run's bug seen from a warm candidate).

When none does but q, k and v match the reference where attention read them, the attention
(mask, scale, softmax or o_proj) differs, shown by the tiers alone: attention_mismatch without an
explanation. The rows are tested for all chunks at once, then chunk by chunk where one
hypothesis does not explain them all. Positions read from a cache have no attention output:
`diagnose_missing_context_in_cache` reads their K/V a layer later.
"""

from __future__ import annotations

import logging

import numpy as np

from kvdiff.analysis.attention import differing_heads, span_attention
from kvdiff.analysis.attention_fit import AttentionRows, AttentionTest
from kvdiff.analysis.attention_rounding import output_rounded, rounding_note
from kvdiff.analysis.attention_verdict import Verdict, explain, explain_reference
from kvdiff.analysis.diagnosis import Diagnosis, DiagnosisInputs, fmt, group_by_chunk, runs, span_text
from kvdiff.analysis.latent import attention_points, attention_rows, rope_columns, value_point
from kvdiff.analysis.operation import attention_point
from kvdiff.analysis.output_accounts import FACTOR_ROWS, moved_rows
from kvdiff.analysis.rope import frame_shift, rotate
from kvdiff.analysis.diagnose_cached_context import diagnose_missing_context_in_cache  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

_NOISE = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 1e-2}     # relative rounding of recorded rows


def _inputs_match(inputs: DiagnosisInputs, row: int, cols: np.ndarray) -> bool:
    """q at `cols` and k, v (with latent attention the latent) at every comparable position up to the
    last of them within tolerance."""
    q_ok, k_ok, v_ok = inputs.ok("q", row), inputs.ok("k", row), inputs.ok(value_point(inputs.reference.meta.dims), row)
    if q_ok is None or k_ok is None or v_ok is None:
        return False
    upto = np.arange(k_ok.size) <= cols.max()
    comparable = inputs.comparison.alignment.comparable
    return bool(q_ok[cols].all() and (k_ok | ~comparable)[upto].all() and (v_ok | ~comparable)[upto].all())


def _layer_rows(inputs: DiagnosisInputs) -> tuple[int, np.ndarray] | None:
    """The first layer row with attention's output breaking tolerance at computed, comparable positions,
    and those columns."""
    al, point = inputs.comparison.alignment, attention_point(inputs.comparison)
    for row in range(len(inputs.comparison.layers)):
        bad = inputs.divergent(point, row)
        if bad is None:
            return None
        cols = np.flatnonzero(bad & al.computed & al.comparable)
        if cols.size:
            return row, cols
    return None


def _test(inputs: DiagnosisInputs, layer: int, cols: np.ndarray) -> list[tuple[AttentionTest, str]] | None:
    """The attention test over `cols` (and, where the candidate's q and k at a row are rotated by
    different offsets from the reference's, the same with q rotated into its keys' frame), or None
    when the keys are not all recorded (positions 0..last) or cannot be expanded (attention_rows)."""
    positions, dims = inputs.comparison.alignment.positions, inputs.reference.meta.dims
    last = int(cols.max())
    if not attention_points(dims) <= set(inputs.comparison.points) or \
            not np.array_equal(positions[:last + 1], np.arange(last + 1)) or \
            dims.sinks and "attn_sinks" not in inputs.comparison.points:      # no softmax to recompute
        return None
    qkv = attention_rows(inputs, layer)
    if qkv is None:
        return None
    scale = dims.attn_scale        # the model's: a candidate declaring another is tested
    point = attention_point(inputs.comparison)
    out = [rows.reshape(rows.shape[0], -1) for rows in inputs.rows(layer, point)]
    sinks = inputs.rows(layer, "attn_sinks") if dims.sinks else (None, None)
    ref, cand = (AttentionRows(*qkv[i], out[i], scale, sinks[i]) for i in (0, 1))
    noise = max(_NOISE.get(t.meta.dtype, 1e-2) for t in (inputs.reference, inputs.candidate))
    test = AttentionTest.build(ref, cand, cols, noise, recorded=point == "z", window=dims.window_of(layer))
    if test is None:
        return None
    if point == "z":        # where only some heads differ, the others only dilute what a hypothesis explains
        tol = inputs.comparison.tolerances.for_point(point)
        test.heads = differing_heads(ref.out, cand.out, test.rows, ref.dims[0], tol.atol, tol.rtol)
    tests = [(test, "")]
    rope = rope_columns(dims)
    horizon = int(positions.max()) + 1
    delta = None if inputs.thetas is None else frame_shift(
        inputs.thetas, horizon, {"q": (ref.q[..., rope], cand.q[..., rope]), "k": inputs.rows(layer, "k")}, test.rows)
    if delta is not None:
        q = cand.q.copy()
        q[test.rows, ..., rope] = rotate(q[test.rows, ..., rope], delta.astype(np.float64), inputs.thetas)
        moved = AttentionRows(q, cand.k, cand.v, cand.out, scale, cand.sinks)
        shifts = ", ".join(f"{int(d):+d}" for d in np.unique(delta[delta != 0]))
        tests.append((AttentionTest(ref, moved, test.rows, test.fit, heads=test.heads, window=test.window),
                      f" (with q rotated {shifts} positions to its keys' RoPE offset)"))
    return tests


def _boundary_note(verdict: Verdict) -> str:
    b = verdict.boundary
    if b is None or b.residual >= 2 * verdict.best.residual:
        return ""
    return (f"; hiding {span_text(*b.hypothesis.hidden)} instead leaves {fmt(b.residual)}: the span's ends are less "
            f"certain than the span")


def _same_note(verdict: Verdict) -> str:
    if verdict.split:
        return f"; {verdict.split}"
    if not verdict.tied:
        return ""
    return (f"; {verdict.tied[0].hypothesis.text} predicts the same rows: the data do not tell them apart, the "
            f"simpler is named")


def _place(inputs: DiagnosisInputs, row: int, cols: np.ndarray) -> tuple[int, str, float, str, dict]:
    """Where an attention diagnosis stands: its layer, attention's point, that point's worst relative
    difference over `cols`, the text naming the layer and position runs, and the `rows` field where the
    runs are several (the rows between them match the reference: the claim is not theirs)."""
    cmp = inputs.comparison
    layer, point = cmp.layers[row], attention_point(cmp)
    _, attn_rel = inputs.worst(point, row, cols)
    spans = runs(cmp.alignment.positions[cols])
    where = f"layer {layer}, positions {', '.join(span_text(a, b) for a, b in spans)}"
    return layer, point, attn_rel, where, ({"rows": [list(r) for r in spans]} if len(spans) > 1 else {})


def _emit(inputs: DiagnosisInputs, row: int, cols: np.ndarray, verdict: Verdict | None, chunk: str | None,
          proved: bool, data_start: int) -> Diagnosis | None:
    h = None if verdict is None or not verdict.decisive else verdict.best.hypothesis
    if h is not None and h.name == "standard":
        return None
    layer, point, attn_rel, where, only = _place(inputs, row, cols)
    positions = inputs.comparison.alignment.positions
    lo, hi = int(positions[cols[0]]), int(positions[cols[-1]])
    fit = {} if verdict is None else verdict.fields()
    heads = None if verdict is None or verdict.test.heads is None else [int(x) for x in verdict.test.heads]
    if heads is not None:
        where += f" (query heads {', '.join(map(str, heads))} only: the others match the reference there)"
        only["heads"] = heads
    fit = {**fit, **only}
    if h is not None and h.name in ("hidden", "chunk alone"):
        start = inputs.chunks.span(lo)
        unattended = h.hidden if h.name == "hidden" else (int(positions[0]), (start[0] if start else lo) - 1)
        if unattended[1] < unattended[0]:
            return None
        ref_q, ref_k, ref_v = verdict.test.ref.q, verdict.test.ref.k, verdict.test.ref.v
        tested = verdict.test.rows[np.isin(verdict.test.rows, cols)]
        mass, _ = span_attention(ref_q, ref_k, ref_v, positions, tested if tested.size else cols[:1], unattended,
                                 inputs.reference.meta.dims.attn_scale, verdict.test.window)
        u = span_text(*unattended)
        noun, verb = ("position", "was") if unattended[0] == unattended[1] else ("positions", "were")
        evidence = (f"{where}: {point} differs (rel {fmt(attn_rel)}) and is the candidate's own q, k and v attended "
                    f"without {noun} {u}: {noun} {u} {verb} not attended (that explanation leaves "
                    f"{fmt(verdict.best.residual)} of the change unexplained, the next best "
                    f"{'none' if verdict.rival is None else fmt(verdict.rival.residual)}"
                    f"{_boundary_note(verdict)}{_same_note(verdict)}); "
                    f"the reference puts "
                    f"{fmt(100 * float(mass.mean()))}% of its attention mass on them (mean over heads and positions; "
                    f"min {fmt(100 * float(mass.min()))}%)")
        if data_start > int(positions[0]):
            evidence += f"; {point} matches up to position {data_start - 1} and differs from {data_start} on"
        return Diagnosis("missing_context", chunk, (lo, hi), evidence, {
            "unattended": list(unattended), "layer": layer, "reference_attention_mass": float(mass.mean()),
            "reference_attention_mass_min": float(mass.min()), **fit}, confidence=verdict.confidence,
            proof=verdict.proof())
    if h is None and not proved:
        return None
    values = value_point(inputs.reference.meta.dims)          # v, or the latent it is expanded from
    same = f"q, k and {values} match the reference where attention read them" if proved else \
        "recomputed from the candidate's own q, k and v"
    details: dict = {"layer": layer, "explanation": None, "inputs_match": proved, **(fit if h is not None else only)}
    if h is not None:
        details.update(explanation=h.name, **h.fields())
        found = (f": {h.text} explains it (leaves {fmt(verdict.best.residual)} of the change unexplained"
                 f"{_same_note(verdict)})")
    elif (moved := moved_rows(inputs, layer, point, cols)) is not None and moved["count"] == min(cols.size, FACTOR_ROWS):
        details["source_positions"] = moved["sources"]
        found = (f"; its rows are, exactly, the reference's {point} rows of other positions ({moved['text']}): "
                 f"attention's results written to other rows (an output index off{moved['shift']}), not computed "
                 f"otherwise")
    elif point == "z" and (rounded := output_rounded(inputs, layer, cols)) is not None:
        details.update(rounded[0])
        found = rounded[1]
    else:
        found = ("; no tested explanation (hidden keys, another scale, a sliding window, the next key or every later key "
                 "of the forward visible, its own key hidden, the KV heads tiled, a soft-cap, keys never written to the "
                 "cache, K and V swapped, the mask offset, the sinks left out) accounts for it"
                 if verdict is not None else "") + rounding_note(inputs, attn_rel, details)
    itself = "(mask, scale or softmax)" if point == "z" else "(mask, scale, softmax or o_proj)"
    if heads is not None and h is None:
        itself = "of those heads (the K/V their KV head read from the cache, or their mask or softmax)"
    if "rounding" in details:
        itself = "(its output's storage)"
    evidence = f"{where}: {same}, but {point} differs (rel {fmt(attn_rel)}): the attention itself {itself} differs{found}"
    if h is not None:
        return Diagnosis("attention_mismatch", chunk, (lo, hi), evidence, details, confidence=verdict.confidence,
                         proof=verdict.proof())
    proof = (f"q at {cols.size} rows and k, {values} at every earlier position within tolerance, {point} divergent there "
             f"(rel up to {fmt(attn_rel)})") + ("" if verdict is None else f"; {verdict.proof()}")
    return Diagnosis("attention_mismatch", chunk, (lo, hi), evidence, details, confidence=1.0, proof=proof)


def _emit_reference(inputs: DiagnosisInputs, row: int, cols: np.ndarray, own: Verdict, chunk: str | None) -> Diagnosis | None:
    """attention_mismatch on the reference's side: its inputs match, the candidate's z is its own q, k
    and v attended as the model does (`own`), the reference's is not (`explain_reference`)."""
    positions = inputs.comparison.alignment.positions
    verdict = explain_reference(own.test, int(positions[cols[0]]))
    if verdict is None:
        return None
    layer, point, attn_rel, where, only = _place(inputs, row, cols)
    h = verdict.best.hypothesis if verdict.decisive else None
    details: dict = {"layer": layer, "side": "reference", "explanation": None, "inputs_match": True,
                     "candidate_standard_residual": own.best.residual, **only}
    if h is not None:
        details.update(verdict.fields(), explanation=h.name, **h.fields())
        found = (f"; {h.text} explains the reference's (leaves {fmt(verdict.best.residual)} of the change unexplained"
                 f"{_same_note(verdict)})")
    else:
        found = "; no tested explanation accounts for the reference's" + rounding_note(inputs, attn_rel, details)
    evidence = (f"{where}: q, k and v match the reference "
                f"where attention read them, but {point} differs (rel {fmt(attn_rel)}), and it is the reference's attention "
                f"that departs from the model's: the candidate's {point} is its own q, k and v attended as the model does "
                f"(leaves {fmt(own.best.residual)} of the change unexplained), the reference's is not{found}")
    proof = (f"{own.proof()}; {verdict.proof()}")
    return Diagnosis("attention_mismatch", chunk, (int(positions[cols[0]]), int(positions[cols[-1]])), evidence,
                     details, confidence=verdict.confidence if h is not None else 1.0, proof=proof)


def diagnose_missing_context(inputs: DiagnosisInputs) -> list[Diagnosis]:
    """missing_context and attention_mismatch at the first layer whose computed attention output differs."""
    found = _layer_rows(inputs)
    if found is None:
        return []
    row, cols = found
    layer, positions = inputs.comparison.layers[row], inputs.comparison.alignment.positions
    bad = inputs.divergent(attention_point(inputs.comparison), row)
    # rows whose keys are all recorded (every position up to theirs): a window's rows, not a flip's logits row past it
    testable = cols[positions[cols] == cols]
    try:
        tests = None if not testable.size else _test(inputs, layer, testable)
        overall = None if tests is None else explain(tests, inputs)
    except np.linalg.LinAlgError as exc:       # degenerate rows (no fit): the tiers alone may still prove
        log.debug("attention test at layer %s skipped: %s", layer, exc)
        tests = overall = None
    out = []
    for chunk, group in group_by_chunk(inputs, positions[cols]):
        gcols = cols[np.isin(positions[cols], group)]
        verdict = overall
        tested = np.intersect1d(gcols, testable)
        if tests is not None and not overall.decisive and 0 < tested.size < testable.size:
            verdict = explain([(t.on(tested), note) for t, note in tests], inputs)
        start = int(gcols[0])
        while start > 0 and bad[start - 1]:
            start -= 1
        proved = _inputs_match(inputs, row, gcols)
        if proved and verdict is not None and verdict.decisive and verdict.best.hypothesis.name == "standard":
            diagnosis = _emit_reference(inputs, row, gcols, verdict, chunk)
        else:
            diagnosis = _emit(inputs, row, gcols, verdict, chunk, proved, int(positions[start]))
        if diagnosis is not None:
            out.append(diagnosis)
    return out

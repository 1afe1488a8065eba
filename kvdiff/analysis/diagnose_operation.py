"""operation_mismatch: the operation that first breaks differs wherever its inputs match.

`first_operation` names the operation at the first tolerance breach and proves it there (every
input within tolerance where it read them). Here the same operation is checked at every compared
position it computed: where its inputs match the reference and its output does not, the operation
itself differs there (a projection changed, a q/k-norm skipped, a residual add dropped). The
counts are the proof: at how many of the positions with matching inputs the output breaks.

Operations with a rule of their own are left to it: attention (attention_mismatch,
missing_context), RoPE (position_mismatch, rope_mismatch), K/V read from a cache
(cache_content_mismatch), the norms (norm_consistency) and the choice of experts (expert_flip).
"""

from __future__ import annotations

import numpy as np

from kvdiff.analysis.diagnose_cache import head_map, source_layer
from kvdiff.analysis.diagnose_tokens import other_tokens_fed
from kvdiff.analysis.diagnosis import Diagnosis, DiagnosisInputs, fmt, runs, span_text
from kvdiff.analysis.keys import ROTATION
from kvdiff.analysis.metrics import row_metrics
from kvdiff.analysis.operation import first_operation
from kvdiff.analysis.rope import estimate_positions
from kvdiff.analysis.search import Location
from kvdiff.analysis.output_accounts import (FACTOR_ROWS, moved_rows, one_factor, output_factor, output_offset,
                                             recorded_as, routed_to, row_factors, stored_output, tested_rows)
from kvdiff.analysis.tolerance import Tier

_OWN_RULE = ("attention (", "RoPE", "K read from", "V read from", "attention norm", "MLP norm", "final norm", "between ",
             "top-k expert choice", "attention post-norm", "MLP post-norm")


def _tiers(inputs: DiagnosisInputs, point: str, layer: int | None) -> np.ndarray | None:
    """Tier per aligned position of `point` at `layer` (None: a final point), or None if not compared."""
    cmp = inputs.comparison
    pmap = cmp.final.get(point) if layer is None else cmp.points.get(point)
    if pmap is None or layer not in pmap.layers:
        return None
    return pmap.tier[pmap.layers.index(layer)]


def _finite(inputs: DiagnosisInputs, point: str, layer: int | None) -> np.ndarray:
    cmp = inputs.comparison
    pmap = cmp.final[point] if layer is None else cmp.points[point]
    row = pmap.layers.index(layer)
    return pmap.ref_finite[row] & pmap.cand_finite[row]


ROPE_ON_BOTH = "RoPE (on q and k)"
RECORDED_CONFIDENCE = 0.3     # at most, where the output is another point's rows: likely the recording, not the engine
AMPLIFIED_CONFIDENCE = 0.5    # at most, where every broken position's inputs differ in their bits, within tolerance


def diagnose_operation(inputs: DiagnosisInputs, where: Location | None, rope_claimed: bool = True) -> list[Diagnosis]:
    """One operation_mismatch for the operation at the first tolerance breach, when its inputs are
    proved to match there and no other rule owns it (RoPE on q and k too, where the RoPE rules made
    no claim: `rope_claimed` False; k alone departing is a key stored otherwise, the cache rules')."""
    op = first_operation(inputs.comparison, where)
    if op is None or not op.proved or op.name.startswith(_OWN_RULE) and not (op.name == ROPE_ON_BOTH and not rope_claimed):
        return []
    al = inputs.comparison.alignment
    out_tier = _tiers(inputs, op.tensor, op.layer)
    if out_tier is None:
        return []
    matching, carried = al.comparable & al.computed, np.zeros(al.positions.size, bool)
    checks = [c for c in op.inputs if not (op.name == ROPE_ON_BOTH and c.point == "k")]    # k: RoPE's output too
    for check in checks:
        tier = _tiers(inputs, check.point, check.layer)
        if tier is None:
            return []
        matching &= (tier == Tier.BITWISE) | (tier == Tier.NOISE)
        carried |= tier == Tier.NOISE
    broken = matching & (out_tier == Tier.DIVERGENT) & _finite(inputs, op.tensor, op.layer)
    if not broken.any():
        return []
    positions = al.positions[broken]
    n, m = int(broken.sum()), int(matching.sum())
    lo, hi = int(positions[0]), int(positions[-1])
    cols = np.flatnonzero(broken)
    if op.name == "embedding" and (fed := other_tokens_fed(inputs, cols)) is not None:
        return [fed]
    pmap = inputs.comparison.final[op.tensor] if op.layer is None else inputs.comparison.points[op.tensor]
    row = pmap.layers.index(op.layer)
    rel = float(np.nanmax(pmap.rel[row, cols]))
    ins = ", ".join(f"{c.point}" + ("" if c.layer is None else f"@{c.layer}") for c in checks) or "none"
    where_text = "final" if op.layer is None else f"layer {op.layer}"
    spans = ", ".join(span_text(a, b) for a, b in runs(positions)[:4]) + ("..." if len(runs(positions)) > 4 else "")
    every = "every one" if n == m else f"{n} of them"
    recorded = recorded_as(inputs, op, cols)
    layers = inputs.comparison.layers
    other_layer = source_layer(inputs, [op.tensor], layers.index(op.layer), cols[:FACTOR_ROWS]) \
        if recorded is None and op.layer in layers else None
    moved = moved_rows(inputs, op.layer, op.tensor, cols) if recorded is None and other_layer is None else None
    verdict = "the operation itself differs" + _not_rotated(inputs, op.name, cols)
    if other_layer is not None:
        verdict = (f"but those rows are, exactly, the reference's {op.tensor} rows of layer {other_layer}: another "
                   f"layer's rows under this layer's index (the trace's layers labelled otherwise, or the layers run "
                   f"out of order), not the operation computing otherwise")
    elif recorded is not None:
        verdict = (f"but the candidate's {op.tensor} rows there are exactly its own {recorded} rows, which the "
                   f"reference's are not: its trace holds {recorded} under the name {op.tensor} (a recording that took "
                   f"the wrong tensor, such as an adapter's), so the operation is not shown to differ")
    elif moved is not None:
        verdict = (f"but {moved['count']} of those rows are, exactly, the reference's rows of other positions "
                   f"({moved['text']}): rows written to or read from other positions (a write index or slot "
                   f"off{moved['shift']}), not the operation computing otherwise")
    evidence = (f"{where_text}: {op.name} breaks where its inputs ({ins}) match the reference: of the {m} compared "
                f"positions with matching inputs, its output {op.tensor} differs at {every} (positions {spans}; rel up "
                f"to {fmt(rel)}): {verdict}" + ("" if n == m or recorded or moved or other_layer is not None
                                               else ", not at every position"))
    proof = (f"{op.tensor} divergent at {n} of {m} positions where {ins} are within tolerance"
             + ("" if recorded is None else f"; the candidate's {op.tensor} = its own {recorded} exactly there")
             + ("" if moved is None else f"; {moved['count']} {op.tensor} rows equal the reference's at other "
                                         f"positions exactly")
             + ("" if other_layer is None else f"; {op.tensor} equals the reference's at layer {other_layer} exactly"))
    details = {"operation": op.name, "layer": op.layer, "tensor": op.tensor, "positions_broken": n,
               "positions_inputs_match": m, "output_factor": None, "recorded_as": recorded,
               **({} if other_layer is None else {"source_layer": other_layer}),
               **({} if moved is None else {"source_positions": moved["sources"]})}
    expert = routed_to(inputs, op.layer, broken, matching, out_tier != Tier.BITWISE) \
        if op.tensor == "mlp_out" and n < m else None
    details["routed_expert"] = None if expert is None else {"expert": expert[0], "first_choice": expert[1]}
    if expert is not None:
        how = f"expert {expert[0]}" + (" as its first choice" if expert[1] else "")
        evidence += (f"; every broken row chose {how}, and every row that did differs (no other beyond tolerance): "
                     f"that expert's weights or its mixing weight differ")
        proof += f"; every broken row chose {how}, and every row that did differs"
    accounted = moved is not None or other_layer is not None        # rows of other positions or layers
    ref_rows, cand_rows = tested_rows(inputs, op.layer, op.tensor, cols)
    factor = None if accounted else output_factor(ref_rows, cand_rows)
    stored = None
    rotated = _q_rotation(inputs, op.layer, cols) if op.tensor == "q" else None
    details["q_rotation"] = rotated
    if rotated is not None:
        evidence += (f"; q is the reference's q rotated by {rotated['text']} at every one of them (exact rotations, "
                     f"fit quality >= {fmt(rotated['fit_quality'])}): RoPE rotated q to other positions than k")
        proof += f"; q = the reference's q rotated by {rotated['text']} (fit quality >= {fmt(rotated['fit_quality'])})"
        factor = None
    passed = _passed_input(inputs, op, cols) if len(op.inputs) > 1 else None
    details["output_is_input"] = passed
    if passed is not None:
        others = ", ".join(c.point for c in op.inputs if c.point != passed)
        evidence += (f"; its output is its input {passed} alone, within tolerance at every one of them: the other "
                     f"input ({others}) was not combined in")
        proof += f"; {op.tensor} within tolerance of the candidate's own {passed} at those positions"
    weighted = _input_weight(inputs, op, cols) if passed is None and op.name.startswith("residual add") else None
    unaccounted = not accounted and passed is None        # no account above: the rows' own accounts below
    details["input_weight"] = weighted
    if weighted is not None:
        evidence += (f"; its output is {weighted['kept']} plus {fmt(weighted['weight'])} x {weighted['scaled']} (that "
                     f"leaves {fmt(weighted['left'])} of the change unexplained): the add weighted {weighted['scaled']}")
        proof += (f"; {op.tensor} = {weighted['kept']} + {fmt(weighted['weight'])} x {weighted['scaled']}, "
                  f"{fmt(weighted['left'])} of the change left")
    elif factor is not None:
        details["output_factor"] = factor[0]
        evidence += (f"; its output is the reference's times {fmt(factor[0])} (that leaves {fmt(factor[1])} of the "
                     f"change unexplained): the operation's weights or its result scaled by one factor")
        proof += f"; {op.tensor} = {fmt(factor[0])} x the reference's, {fmt(factor[1])} of the change left"
    elif unaccounted and (stored := stored_output(ref_rows, cand_rows, op.tensor)) is not None:
        details.update(stored.details)
        evidence += f"; {stored.evidence}"
        proof += f"; {stored.proof}"
    elif unaccounted and (heads := head_map(ref_rows, cand_rows)) is not None:
        details["head_map"] = heads
        held = ", ".join(f"head {i} holds head {j}'s" for i, j in enumerate(heads) if i != j)
        evidence += (f"; each of its heads is, exactly, one of the reference's heads of this layer, but not every one "
                     f"its own ({held} rows): heads written to or read from another head's place (a head index off)")
        proof += f"; every broken row's head i = the reference's head head_map[i] (head_map {heads}), exactly"
    elif unaccounted and (offset := output_offset(ref_rows, cand_rows)) is not None:
        details["output_offset"] = offset
        evidence += (f"; every row is the reference's plus one and the same vector (norm {fmt(offset['norm'])}, leaving "
                     f"{fmt(offset['left'])} of the change): a bias added or left out")
        proof += f"; {op.tensor} = the reference's + one constant vector, {fmt(offset['left'])} of the change left"
    elif unaccounted and (rows := row_factors(ref_rows, cand_rows)) is not None:
        details["row_factors"] = rows
        evidence += (f"; each row is the reference's times a factor of its own ({fmt(rows['min'])} to "
                     f"{fmt(rows['max'])}, leaving at most {fmt(rows['left'])} of a row's change): a weight per token "
                     f"scaled the result (such as a mixture's routing weights not renormalised over its chosen experts)")
        proof += f"; every broken row = its own factor x the reference's ({fmt(rows['min'])}-{fmt(rows['max'])})"
    # the share of positions broken hedges a claim the tiers alone make (inputs within tolerance may still
    # be amplified past it); an exact account of every broken position is a proof of its own
    proved = (rotated is not None or passed is not None or weighted is not None or details["output_factor"] is not None
              or "row_factors" in details or "output_offset" in details or "source_positions" in details
              or stored is not None or other_layer is not None or "head_map" in details or expert is not None)
    confidence = 1.0 if proved else n / m
    if not proved and carried[broken].all():      # no position with bitwise inputs proves the operation itself
        confidence = min(confidence, AMPLIFIED_CONFIDENCE)
        evidence += (f"; but at every one of them its inputs already differ from the reference's in their bits "
                     f"(within tolerance), which it carries on: the breach may be theirs amplified past {op.tensor}'s "
                     f"tolerance, not the operation differing")
    return [Diagnosis("operation_mismatch", inputs.chunks.chunk_of(lo), (lo, hi), evidence, details,
                      confidence=confidence if recorded is None else min(confidence, RECORDED_CONFIDENCE), proof=proof)]


def _not_rotated(inputs: DiagnosisInputs, name: str, cols: np.ndarray) -> str:
    """For RoPE: where the candidate's k at `cols` keeps none of its k_pre_rope's rotate_half pair
    magnitudes, that no rotation with the model's pairs gives it (RoPE computing otherwise)."""
    keys = inputs.keys if name == ROPE_ON_BOTH else None
    if keys is None or not np.isin(cols, keys.cols).all() or (keys.kind[np.isin(keys.cols, cols)] == ROTATION).any():
        return ""
    return (": k's rotate_half pairs do not keep the magnitudes of its own k_pre_rope (which matches the "
            "reference's), so no rotation with the model's pairs gives it: RoPE paired or rotated the dimensions "
            "otherwise (other pairs, a partial rotary dimension, another layout), not to other positions")


def _q_rotation(inputs: DiagnosisInputs, layer: int, cols: np.ndarray) -> dict | None:
    """Where the candidate's q at `cols` (up to FACTOR_ROWS) is, row by row, the reference's q
    rotated by a whole number of positions with the reference's frequencies: the offsets (one, or
    each row's own position back to 0: q carries no RoPE) and the worst fit quality; else None."""
    if inputs.thetas is None:
        return None
    al, cols = inputs.comparison.alignment, cols[:FACTOR_ROWS]
    ref, cand = (rows[cols] for rows in inputs.rows(layer, "q"))
    if ref.shape[-1] != 2 * inputs.thetas.size:        # RoPE on part of q only (latent attention): not tested
        return None
    horizon = 2 * int(al.positions.max()) + 64
    shift, quality = estimate_positions(ref, cand, inputs.thetas, horizon, -horizon, batch=8)
    slack = 2e-3 if "bfloat16" in (inputs.reference.meta.dtype, inputs.candidate.meta.dtype) else 1e-4
    if not (quality >= 1 - slack).all() or not shift.any():
        return None
    positions = al.positions[cols]
    offsets = np.unique(shift)
    if (shift == -positions).all():
        text = "minus its own position (back to position 0: q carries no RoPE)"
    elif offsets.size == 1:
        text = f"{int(offsets[0]):+d} positions"
    else:
        text = f"{offsets.size} different offsets ({', '.join(f'{int(o):+d}' for o in offsets[:4])}...)"
    return {"offsets": [int(o) for o in offsets[:8]], "no_rope": bool((shift == -positions).all()),
            "fit_quality": float(quality.min()), "text": text}


def _passed_input(inputs: DiagnosisInputs, op, cols: np.ndarray) -> str | None:
    """The input of `op` (a residual add: several inputs) that the candidate's output equals, within
    the output's tolerance, at every one of `cols` (up to FACTOR_ROWS), or None."""
    al, cols = inputs.comparison.alignment, cols[:FACTOR_ROWS]
    out = inputs.candidate.point(op.layer, op.tensor, al.cand_index[cols])
    tolerance = inputs.comparison.tolerances.for_point(op.tensor)
    for check in op.inputs:
        rows = inputs.candidate.point(check.layer, check.point, al.cand_index[cols])
        if rows.shape == out.shape and row_metrics(rows, out).within(tolerance).all():
            return check.point
    return None


def _input_weight(inputs: DiagnosisInputs, op, cols: np.ndarray) -> dict | None:
    """Where the candidate's output of a two-input add at `cols` (up to FACTOR_ROWS) is one input plus
    c times the other (c not 1), leaving at most output_accounts.FACTOR_LEFT of its change from the reference's:
    {"scaled", "kept", "weight", "left"}; else None."""
    if len(op.inputs) != 2:
        return None
    al, cols = inputs.comparison.alignment, cols[:FACTOR_ROWS]
    out = inputs.candidate.point(op.layer, op.tensor, al.cand_index[cols]).astype(np.float64)
    change = float(np.linalg.norm(out - inputs.reference.point(op.layer, op.tensor, al.ref_index[cols])))
    rows = {c.point: inputs.candidate.point(c.layer, c.point, al.cand_index[cols]).astype(np.float64)
            for c in op.inputs}
    if any(r.shape != out.shape for r in rows.values()):
        return None
    for scaled, kept in (tuple(rows), tuple(rows)[::-1]):
        fit = one_factor(out - rows[kept], rows[scaled], change)
        if fit is not None and abs(fit[0] - 1) > 1e-3:
            return {"scaled": scaled, "kept": kept, "weight": fit[0], "left": fit[1]}
    return None

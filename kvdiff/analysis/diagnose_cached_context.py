"""missing_context of K/V the candidate read from its cache (no attn_out recorded there).

They match the reference at one recorded layer and differ at the next while every earlier
position's K/V still match, so the hidden states they were computed from (which attend to the
context) differ. "Match" is up to RoPE: keys rotated to other positions (a position_mismatch of
the first layer, the same offset at later layers) hold the same content, and v, which RoPE does
not touch, decides. The claim that the chunk was computed without the positions before it is
tested where the data allow: a chunk whose first token is the conversation's first token, computed
alone, holds at every layer the reference's v of position 0 at its first row (a row that attends
only itself does not depend on its position). Where no such test applies, or it fails, only what
the data prove is claimed: a cache_content_mismatch of rows computed from other hidden states
(`computed_otherwise`), whatever they attended otherwise. Neither is claimed of rows whose content
diagnose_cache_layers proves stored otherwise (another layer's, heads rearranged, K and V swapped,
one of them alone differing, a narrower format).
"""

from __future__ import annotations

import numpy as np

from kvdiff.analysis.attention import span_attention
from kvdiff.analysis.diagnose_cache_layers import explains
from kvdiff.analysis.diagnosis import Diagnosis, DiagnosisInputs, fmt, group_by_chunk, span_text
from kvdiff.analysis.keys import ROTATION
from kvdiff.analysis.latent import attention_points, attention_rows, value_point
from kvdiff.analysis.metrics import row_metrics
from kvdiff.analysis.rope import rotate


def _k_ok(inputs: DiagnosisInputs, row: int) -> np.ndarray:
    """k within tolerance, or (positions whose first-layer keys are an exact rotation to other
    positions) the reference's k rotated by that offset."""
    ok = inputs.ok("k", row).copy()
    keys, layer = inputs.keys, inputs.comparison.layers[row]
    if keys is None or inputs.thetas is None:
        return ok
    rotated = (keys.kind == ROTATION) & keys.exact
    cols = keys.cols[rotated]
    if not cols.size:
        return ok
    offsets = (keys.encoded[rotated] - inputs.comparison.alignment.positions[cols]).astype(np.float64)
    ref_k, cand_k = inputs.rows(layer, "k")
    moved = rotate(ref_k[cols], offsets, inputs.thetas)
    ok[cols] |= row_metrics(moved, cand_k[cols]).within(inputs.comparison.tolerances.for_point("k"))
    return ok


def _first_row(inputs: DiagnosisInputs, row: int, start: int, point: str) -> tuple[bool, float] | None:
    """(the chunk's first row holds the reference's v (`point`: v, or the latent) of position 0 at this
    layer, its rel), where the chunk starts with the conversation's first token and that row was read
    from the cache."""
    al = inputs.comparison.alignment
    ids = inputs.reference.meta.input_ids
    col = np.searchsorted(al.positions, start)
    if col >= al.positions.size or al.positions[col] != start or al.positions[0] != 0 or not al.kv_only[col] \
            or start >= ids.size or ids[start] != ids[0]:
        return None
    ref_v, cand_v = inputs.rows(inputs.comparison.layers[row], point)
    metrics = row_metrics(ref_v[:1], cand_v[col:col + 1])
    return bool(metrics.within(inputs.comparison.tolerances.for_point(point))[0]), float(metrics.rel[0])


def diagnose_missing_context_in_cache(inputs: DiagnosisInputs) -> list[Diagnosis]:
    cmp = inputs.comparison
    al = cmp.alignment
    cached, dims = al.kv_only & al.comparable, inputs.reference.meta.dims
    vp = value_point(dims)
    if not cached.any() or len(cmp.layers) < 2 or not attention_points(dims) <= set(cmp.points):
        return []
    for row in range(1, len(cmp.layers)):
        k_before, k_now = _k_ok(inputs, row - 1), _k_ok(inputs, row)
        before_ok = k_before & inputs.ok(vp, row - 1)
        now_bad = inputs.divergent(vp, row) | (inputs.divergent("k", row) & ~k_now)
        context_ok = np.logical_and.accumulate(before_ok | ~al.comparable)
        cols = np.flatnonzero(now_bad & before_ok & context_ok & cached)
        if cols.size:
            break
    else:
        return []
    before, layer, positions = cmp.layers[row - 1], cmp.layers[row], al.positions
    qkv = attention_rows(inputs, before)
    if qkv is None:
        return []
    ref_q, ref_k, ref_v = qkv[0]
    out = []
    for chunk, group in group_by_chunk(inputs, positions[cols]):
        gcols = cols[np.isin(positions[cols], group)]
        if explains(inputs, row, gcols):          # what the cache holds is claimed there (diagnose_cache_layers)
            continue
        span = inputs.chunks.span(int(group[0]))
        _, k_rel = inputs.worst("k", row, gcols)
        _, v_rel = inputs.worst(vp, row, gcols)
        lo, hi = int(group[0]), int(group[-1])
        if span is None or span[0] <= int(positions[0]):        # no context before the chunk to have missed
            out.append(_computed_otherwise(inputs, chunk, (lo, hi), before, layer, vp, k_rel, v_rel, None))
            continue
        unattended = (int(positions[0]), span[0] - 1)
        mass, _ = span_attention(ref_q, ref_k, ref_v, positions, gcols, unattended, dims.attn_scale,
                                 dims.window_of(before))
        evidence = (f"positions {span_text(lo, hi)}, read from the cache: their k and {vp} match the reference at layer "
                    f"{before} (k up to RoPE), and so do K/V at every earlier position, but differ at layer "
                    f"{layer} (k rel {fmt(k_rel)}, {vp} rel {fmt(v_rel)}), so the cached chunk {chunk!r} was computed "
                    f"without the reference's context at positions {span_text(*unattended)} (alone, or after other "
                    f"content); at layer {before} the reference puts {fmt(100 * float(mass.mean()))}% of these "
                    f"positions' attention mass there (mean over heads and positions; min {fmt(100 * float(mass.min()))}%)")
        proof = (f"{vp} at layer {before} within tolerance at positions 0-{hi}, {vp} or k at layer {layer} divergent "
                 f"at {gcols.size} rows read from the cache ({vp} rel up to {fmt(v_rel)})")
        first = _first_row(inputs, row, span[0], vp)
        if first is None or not first[0]:
            out.append(_computed_otherwise(inputs, chunk, (lo, hi), before, layer, vp, k_rel, v_rel, first))
            continue
        note = (f"its first row, position {span[0]} (the conversation's first token again), holds at layer {layer} "
                f"the reference's {vp} of position 0 (rel {fmt(first[1])}): it attended only itself, as a chunk computed "
                f"alone does")
        out.append(Diagnosis("missing_context", chunk, (lo, hi), f"{evidence}; {note}", {
            "unattended": list(unattended), "layer": layer, "cached": True,
            "reference_attention_mass": float(mass.mean()), "reference_attention_mass_min": float(mass.min())},
            confidence=1.0, proof=f"{proof}; {note}"))
    return out


def _computed_otherwise(inputs: DiagnosisInputs, chunk: str | None, span: tuple[int, int], before: int, layer: int,
                        vp: str, k_rel: float, v_rel: float, first: tuple[bool, float] | None) -> Diagnosis:
    """What the data prove of cached rows whose K/V match at one layer and differ at the next, where
    no test tells which context they lacked: they were computed from other hidden states."""
    lo, hi = span
    note = "" if first is None else (
        f"; its first row, position {lo} (the conversation's first token again), does not hold the reference's {vp} of "
        f"position 0 at layer {layer} (rel {fmt(first[1])}): not computed alone")
    evidence = (f"layer {layer}, positions {span_text(lo, hi)}, read from the cache: their k and {vp} match the reference "
                f"at layer {before} (k up to RoPE), and so do K/V at every earlier position, but differ at layer {layer} "
                f"(k rel {fmt(k_rel)}, {vp} rel {fmt(v_rel)}): the rows were computed from other hidden states than the "
                f"reference's, so what they attended when the cache was written differed (other positions before them, "
                f"keys after them in the forward that computed them, another mask or scale); the data here do not tell "
                f"which{note}")
    return Diagnosis("cache_content_mismatch", chunk, (lo, hi), evidence,
                     {"layer": layer, "computed_otherwise": True, "points": ["k", vp], "rounding": None},
                     confidence=1.0, proof=f"{vp} at layer {before} within tolerance at positions 0-{hi}, {vp} or k at "
                                           f"layer {layer} divergent at the rows read from the cache{note}")

"""missing_context: q, k and v equal at a position but attn_out differs, so the attended set differs."""

from __future__ import annotations

import logging

import numpy as np

from kvdiff.analysis.attention import span_attention
from kvdiff.analysis.diagnosis import Diagnosis, DiagnosisInputs, fmt, group_by_chunk, span_text
from kvdiff.analysis.metrics import row_metrics
from kvdiff.analysis.rope import estimate_positions, rotate
from kvdiff.analysis.tolerance import Tier

log = logging.getLogger(__name__)

# Leaving a span out moves the attention output by `span_attention`'s shift of its norm; o_proj, which
# the trace does not hold, scales that by far less than this. A change of attn_out this many times
# smaller than the shift refutes the missing span (rounding, e.g. another dtype, explains it).
_SHIFT_TO_CHANGE = 100.0


def _q_shift(inputs: DiagnosisInputs, layer: int, cols: np.ndarray) -> np.ndarray:
    """Per column: the RoPE shift that maps the reference q onto the candidate q, or -1<<62 if none does."""
    none = np.full(cols.size, -(1 << 62), dtype=np.int64)
    if inputs.thetas is None or not cols.size:
        return none
    ref_q, cand_q = (q[cols] for q in inputs.rows(layer, "q"))
    horizon = int(inputs.comparison.alignment.positions.max()) + 1
    shift, _ = estimate_positions(ref_q, cand_q, inputs.thetas, horizon, -horizon)
    back = rotate(cand_q, -shift.astype(np.float64), inputs.thetas)
    tol = inputs.comparison.tolerances.for_point("q")
    ok = row_metrics(ref_q, back).tiers(tol) <= Tier.NOISE
    return np.where(ok, shift, none)


def _content_ok(inputs: DiagnosisInputs, row: int) -> np.ndarray | None:
    v_ok = inputs.ok("v", row)
    k_ok = inputs.ok("k_pre_rope", row)
    k_ok = inputs.ok("k", row) if k_ok is None else k_ok
    return None if v_ok is None or k_ok is None else v_ok & k_ok


def _flagged(inputs: DiagnosisInputs) -> tuple[int, np.ndarray, np.ndarray] | None:
    """The first layer row with positions whose q/k/v match (q up to RoPE) and whose context K/V
    match, but whose attn_out breaches tolerance; with those columns and their q shifts."""
    cmp = inputs.comparison
    comparable = cmp.alignment.comparable
    for row, layer in enumerate(cmp.layers):
        content, attn_bad, q_ok = _content_ok(inputs, row), inputs.divergent("attn_out", row), inputs.ok("q", row)
        if content is None or attn_bad is None or q_ok is None:
            return None
        context_ok = np.logical_and.accumulate(content | ~comparable)
        cols = np.flatnonzero(attn_bad & content & context_ok & comparable)
        if not cols.size:
            continue
        shift = np.zeros(cols.size, dtype=np.int64)
        rotated = ~q_ok[cols]
        shift[rotated] = _q_shift(inputs, layer, cols[rotated])
        keep = shift > -(1 << 62)
        if keep.any():
            return row, cols[keep], shift[keep]
    return None


def _run_start(attn_bad: np.ndarray, col: int) -> int:
    """First column of the run of attn_out-divergent columns that ends at or passes `col`."""
    while col > 0 and attn_bad[col - 1]:
        col -= 1
    return col


def diagnose_missing_context(inputs: DiagnosisInputs) -> list[Diagnosis]:
    found = _flagged(inputs)
    if found is None:
        return []
    row, cols, shifts = found
    cmp = inputs.comparison
    layer, positions = cmp.layers[row], cmp.alignment.positions
    ref_q, ref_k = inputs.rows(layer, "q")[0], inputs.rows(layer, "k")[0]
    out = []
    for chunk, group in group_by_chunk(inputs, positions[cols]):
        in_group = np.isin(positions[cols], group)
        gcols = cols[in_group]
        data_start = int(positions[_run_start(inputs.divergent("attn_out", row), int(gcols[0]))])
        span = inputs.chunks.span(int(group[0]))
        start = span[0] if span is not None else data_start
        if start <= int(positions[0]):
            continue
        unattended = (int(positions[0]), start - 1)
        scale = inputs.reference.meta.dims.attn_scale
        mass, shift = span_attention(ref_q, ref_k, inputs.rows(layer, "v")[0], positions, gcols, unattended, scale)
        ref_out, cand_out = (rows[gcols].astype(np.float64) for rows in inputs.rows(layer, "attn_out"))
        with np.errstate(invalid="ignore", divide="ignore"):
            change = np.linalg.norm(cand_out - ref_out, axis=1) / np.linalg.norm(ref_out, axis=1)
        if change.mean() * _SHIFT_TO_CHANGE < shift.mean():
            log.debug("attn_out at %s changed by %.3g of its norm, but leaving %s out would move it by %.3g: "
                      "not a missing context", span_text(int(group[0]), int(group[-1])), change.mean(),
                      span_text(*unattended), shift.mean())
            continue
        _, attn_rel = inputs.worst("attn_out", row, gcols)
        lo, hi = int(group[0]), int(group[-1])
        qnote = "" if not shifts[in_group].any() else f" (after undoing a RoPE shift of {int(shifts[in_group][0]):+d})"
        source = f"the candidate's chunk {chunk!r} starts at {start}" if span is not None else \
            f"attn_out matches up to position {data_start - 1} and differs from {data_start} on"
        evidence = (f"layer {layer}, positions {span_text(lo, hi)}: q{qnote}, k and v match the reference, and so do "
                    f"K/V at every earlier position, but attn_out differs (rel {fmt(attn_rel)}); {source}, so positions "
                    f"{span_text(*unattended)} were not attended; the reference puts {fmt(100 * float(mass.mean()))}% "
                    f"of its attention mass on them (mean over heads and positions; min {fmt(100 * float(mass.min()))}%)")
        if span is not None and data_start != start:
            evidence += f"; attn_out itself first differs at position {data_start}"
        out.append(Diagnosis("missing_context", chunk, (lo, hi), evidence, {
            "unattended": list(unattended), "layer": layer,
            "reference_attention_mass": float(mass.mean()), "reference_attention_mass_min": float(mass.min())}))
    return out


def diagnose_missing_context_in_cache(inputs: DiagnosisInputs) -> list[Diagnosis]:
    """missing_context of K/V the candidate read from its cache: they match the reference at one
    recorded layer and differ at the next while every earlier position's K/V still match, so the
    hidden states they were computed from (which attend to the context) differ. Their attn_out
    was never recorded: the rule above cannot see them."""
    cmp = inputs.comparison
    al = cmp.alignment
    cached = al.kv_only & al.comparable
    if not cached.any() or len(cmp.layers) < 2 or not {"q", "k", "v"} <= set(cmp.points):
        return []
    for row in range(1, len(cmp.layers)):
        before_ok = inputs.ok("k", row - 1) & inputs.ok("v", row - 1)
        now_bad = inputs.divergent("k", row) | inputs.divergent("v", row)
        context_ok = np.logical_and.accumulate(before_ok | ~al.comparable)
        cols = np.flatnonzero(now_bad & before_ok & context_ok & cached)
        if cols.size:
            break
    else:
        return []
    before, layer, positions = cmp.layers[row - 1], cmp.layers[row], al.positions
    ref_q, ref_k, ref_v = (inputs.rows(before, point)[0] for point in ("q", "k", "v"))
    out = []
    for chunk, group in group_by_chunk(inputs, positions[cols]):
        gcols = cols[np.isin(positions[cols], group)]
        span = inputs.chunks.span(int(group[0]))
        if span is None or span[0] <= int(positions[0]):
            continue
        unattended = (int(positions[0]), span[0] - 1)
        mass, _ = span_attention(ref_q, ref_k, ref_v, positions, gcols, unattended, inputs.reference.meta.dims.attn_scale)
        _, k_rel = inputs.worst("k", row, gcols)
        _, v_rel = inputs.worst("v", row, gcols)
        lo, hi = int(group[0]), int(group[-1])
        evidence = (f"positions {span_text(lo, hi)}, read from the cache: their k and v match the reference at layer "
                    f"{before}, and so do K/V at every earlier position, but differ at layer {layer} (k rel "
                    f"{fmt(k_rel)}, v rel {fmt(v_rel)}), so the cached chunk {chunk!r} was computed without the "
                    f"reference's context at positions {span_text(*unattended)} (alone, or after other content); "
                    f"at layer {before} the reference puts {fmt(100 * float(mass.mean()))}% of these positions' "
                    f"attention mass there (mean over heads and positions; min {fmt(100 * float(mass.min()))}%)")
        out.append(Diagnosis("missing_context", chunk, (lo, hi), evidence, {
            "unattended": list(unattended), "layer": layer, "cached": True,
            "reference_attention_mass": float(mass.mean()), "reference_attention_mass_min": float(mass.min())}))
    return out

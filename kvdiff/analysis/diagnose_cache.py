"""cache_content_mismatch: first-layer K or V differ before RoPE while their input matches.

In the first layer, k_pre_rope and v are a function of the token's normed embedding alone; if
that input matches and they do not, the candidate read K/V that belong elsewhere (a wrong slot
or block, a stale entry). The rows are matched against every reference row to name the source.
"""

from __future__ import annotations

import numpy as np

from kvdiff.analysis.diagnosis import Diagnosis, DiagnosisInputs, fmt, group_by_chunk, span_text


def _sources(ref: np.ndarray, cand: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each candidate row, the reference position whose row is nearest, and the relative distance
    (Inf for a candidate row that holds NaN or Inf, or overflows)."""
    r = ref.reshape(ref.shape[0], -1).astype(np.float64)
    c = cand.reshape(cand.shape[0], -1).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        dist = (c * c).sum(1)[:, None] - 2 * c @ r.T + (r * r).sum(1)[None, :]
        dist[~np.isfinite(dist)] = np.inf
        best = dist.argmin(axis=1)
        rel = np.sqrt(np.maximum(dist[np.arange(c.shape[0]), best], 0) / np.maximum((c * c).sum(1), 1e-300))
    return positions[best], np.where(np.isnan(rel), np.inf, rel)


def diagnose_cache_content(inputs: DiagnosisInputs) -> list[Diagnosis]:
    kp_bad, v_bad = inputs.divergent("k_pre_rope", 0), inputs.divergent("v", 0)
    if kp_bad is None and v_bad is None:
        return []
    bad = (kp_bad if kp_bad is not None else False) | (v_bad if v_bad is not None else False)
    al = inputs.comparison.alignment
    same_input = inputs.ok("attn_norm", 0)
    same_input = inputs.ok("resid_pre", 0) if same_input is None else same_input
    if same_input is not None:
        # Where the K/V were read from a cache no input was recorded; the tokens are the same at
        # every comparable position, and the first layer's input is the token's embedding.
        bad = bad & (same_input | al.kv_only)
    positions = al.positions
    cached = np.array([inputs.chunks.cached(int(p)) is not False for p in positions], dtype=bool)
    cols = np.flatnonzero(bad & cached & al.comparable)
    if not cols.size:
        return []
    layer = inputs.first_layer
    point = "v" if v_bad is not None and v_bad[cols].any() else "k_pre_rope"
    ref_rows, cand_rows = inputs.rows(layer, point)
    src, dist = _sources(ref_rows, cand_rows[cols], positions)
    out = []
    for chunk, group in group_by_chunk(inputs, positions[cols]):
        sel = np.isin(positions[cols], group)
        gcols = cols[sel]
        lo, hi = int(group[0]), int(group[-1])
        parts = []
        for name in ("k_pre_rope", "v"):
            if inputs.divergent(name, 0) is not None and inputs.divergent(name, 0)[gcols].any():
                max_abs, rel = inputs.worst(name, 0, gcols)
                parts.append(f"{name} differs (max_abs {fmt(max_abs)}, rel {fmt(rel)})")
        where = "whose K/V came from the cache" if any(inputs.chunks.cached(int(p)) for p in group) else \
            "(the trace does not say which positions were cached)"
        same = "the tokens are the same" if al.kv_only[gcols].all() else "the layer input matches"
        evidence = (f"layer {layer}, positions {span_text(lo, hi)} {where}: {' and '.join(parts)} although "
                    f"{same}, and before RoPE these depend on the token alone")
        exact = dist[sel] <= 1e-6
        moved = src[sel] != group
        if (exact & moved).any():
            pairs = ", ".join(f"{p}<-{s}" for p, s in zip(group[exact & moved][:6], src[sel][exact & moved][:6]))
            evidence += f"; the candidate's {point} rows equal the reference's at other positions ({pairs}): a wrong slot or stale entry"
        out.append(Diagnosis("cache_content_mismatch", chunk, (lo, hi), evidence, {
            "layer": layer, "source_positions": [int(s) if d <= 1e-6 else None for s, d in zip(src[sel], dist[sel])]}))
    return out

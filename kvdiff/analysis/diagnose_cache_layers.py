"""cache_content_mismatch past the first layer: cached K/V that hold another layer's rows.

At positions the candidate read from its cache, K/V that match the reference at one layer and
differ at the next may have been computed from other hidden states (a missing context:
diagnose_cached_context.py) or be other content. Only a proof is claimed here: where the
candidate's K and V rows of that layer equal, exactly, the reference's rows of another layer at
the same positions, the cache's layer holds that layer's K/V (a layer index off when the cache
was written or read); where its KV heads equal the reference's heads of the same layer in
another arrangement, exactly, the cache's heads are arranged otherwise (`head_map`).
"""

from __future__ import annotations

import numpy as np

from kvdiff.analysis.diagnose_cache import EXACT, head_map, same_rows
from kvdiff.analysis.diagnosis import Diagnosis, DiagnosisInputs, fmt, group_by_chunk, span_text
from kvdiff.analysis.latent import value_point


def _kv_points(inputs: DiagnosisInputs) -> list[str]:
    """The K/V points both traces recorded (what attention reads from the cache)."""
    vp = value_point(inputs.reference.meta.dims)
    return [p for p in ("k", vp) if p in inputs.comparison.points]


def _first_bad_layer(inputs: DiagnosisInputs, points: list[str], cached: np.ndarray) -> tuple[int, np.ndarray] | None:
    """(layer row, columns): the first layer past the first whose cached K/V diverge at columns where
    every earlier layer's are within tolerance."""
    good = cached.copy()
    for row in range(len(inputs.comparison.layers)):
        bad = np.zeros_like(cached)
        ok = np.ones_like(cached)
        for point in points:
            bad |= inputs.divergent(point, row)
            ok &= inputs.ok(point, row)
        cols = np.flatnonzero(bad & good)
        if cols.size:
            return (row, cols) if row > 0 else None
        good &= ok
    return None


def _source_layer(inputs: DiagnosisInputs, points: list[str], row: int, cols: np.ndarray) -> int | None:
    """The other recorded layer whose reference K and V rows the candidate's rows at layer `row` equal
    at the same positions, every one of them; None when no layer does."""
    layers = inputs.comparison.layers
    cand = {p: inputs.rows(layers[row], p)[1][cols] for p in points}
    for other, layer in enumerate(layers):
        if other != row and all(same_rows(inputs.rows(layer, p)[0][cols], cand[p]).all() for p in points):
            return layer
    return None


def diagnose_cache_layers(inputs: DiagnosisInputs) -> list[Diagnosis]:
    al = inputs.comparison.alignment
    points = _kv_points(inputs)
    cached = al.kv_only & al.comparable
    if not points or not cached.any() or len(inputs.comparison.layers) < 2:
        return []
    found = _first_bad_layer(inputs, points, cached)
    if found is None:
        return []
    row, cols = found
    layer, before = inputs.comparison.layers[row], inputs.comparison.layers[row - 1]
    source = _source_layer(inputs, points, row, cols)
    if source is None:
        return _other_heads(inputs, points, row, cols, before)
    out = []
    for chunk, group in group_by_chunk(inputs, al.positions[cols]):
        gcols = cols[np.isin(al.positions[cols], group)]
        lo, hi = int(group[0]), int(group[-1])
        parts = []
        for point in points:
            max_abs, rel = inputs.worst(point, row, gcols)
            parts.append(f"{point} differs (max_abs {fmt(max_abs)}, rel {fmt(rel)})")
        evidence = (f"layer {layer}, positions {span_text(lo, hi)} whose K/V came from the cache: {' and '.join(parts)} "
                    f"while at layer {before} they match; the candidate's {' and '.join(points)} rows there equal the "
                    f"reference's of layer {source} at the same positions exactly: the cache's layer {layer} holds "
                    f"layer {source}'s K/V (a layer index off where the cache was written or read)")
        proof = (f"{' and '.join(points)} at layer {layer} equal the reference's at layer {source} at all {gcols.size} "
                 f"rows (relative distance <= {EXACT:g}), and differ from its layer {layer} beyond tolerance")
        details = {"layer": layer, "source_layer": source, "source_positions": [int(p) for p in group],
                   "points": points, "rounding": None}
        out.append(Diagnosis("cache_content_mismatch", chunk, (lo, hi), evidence, details, confidence=1.0,
                             proof=proof))
    return out


def _other_heads(inputs: DiagnosisInputs, points: list[str], row: int, cols: np.ndarray,
                 before: int) -> list[Diagnosis]:
    """Cached K/V whose KV heads are the reference's heads of the same layer in another arrangement
    (`head_map`: one head's rows in another's place, or duplicated), exactly, at every differing
    row; nothing where they are not."""
    al, layer = inputs.comparison.alignment, inputs.comparison.layers[row]
    maps = {}
    for point in points:
        ref, cand = (r[cols] for r in inputs.rows(layer, point))
        mapped = head_map(ref, cand)
        if mapped is None and not same_rows(ref, cand).all():
            return []
        if mapped is not None:
            maps[point] = mapped
    if len({tuple(m) for m in maps.values()}) != 1:
        return []
    mapped = next(iter(maps.values()))
    moved = [i for i, j in enumerate(mapped) if i != j]
    out = []
    for chunk, group in group_by_chunk(inputs, al.positions[cols]):
        gcols = cols[np.isin(al.positions[cols], group)]
        lo, hi = int(group[0]), int(group[-1])
        held = ", ".join(f"head {i} holds head {mapped[i]}'s" for i in moved)
        evidence = (f"layer {layer}, positions {span_text(lo, hi)} whose K/V came from the cache: "
                    f"{' and '.join(maps)} differ while at layer {before} they match; each of their KV heads equals one of "
                    f"the reference's heads of this layer exactly, but not its own ({held} rows): the cache's KV heads "
                    f"at layer {layer} are arranged otherwise (a head index off where the cache was written or read)")
        proof = (f"{' and '.join(maps)} at layer {layer}: each candidate head i equals the reference's head "
                 f"head_map[i] (head_map {mapped}) at all {gcols.size} rows (relative distance <= {EXACT:g})")
        details = {"layer": layer, "source_positions": [int(p) for p in group], "points": list(maps),
                   "rounding": None, "head_map": mapped}
        out.append(Diagnosis("cache_content_mismatch", chunk, (lo, hi), evidence, details, confidence=1.0,
                             proof=proof))
    return out

"""cache_content_mismatch past the first layer: cached K/V the cache holds otherwise.

At positions the candidate read from its cache, K/V that match the reference at one layer and
differ at the next may have been computed from other hidden states (a missing context:
diagnose_cached_context.py) or be other content. Only a proof is claimed here: where the
candidate's K and V rows of that layer equal, exactly, the reference's rows of another layer at
the same positions, the cache's layer holds that layer's K/V (a layer index off when the cache
was written or read); where its KV heads equal the reference's heads of the same layer in
another arrangement, exactly, the cache's heads are arranged otherwise (`head_map`); where k is the
reference's v and v its k, they were stored in each other's place; where one of k and v differs
while the other matches (other hidden states move both), or each differing one is the reference's
in a narrower format, another element order or scaled per head, the cache stored it otherwise.
`explains` tells diagnose_cached_context which rows are claimed here. At rows the candidate
computed past the first layer, where attention's inputs there match the reference's (attn_norm,
q, k_pre_rope) and k as attention read it does not, the same accounts are claimed when one of them
holds exactly (not one of k and v differing alone: a projection differing moves one too).
"""

from __future__ import annotations

import numpy as np

from kvdiff.analysis.diagnose_cache import head_map, source_layer, sources, swapped_kv
from kvdiff.analysis.diagnose_position import position_factor
from kvdiff.analysis.diagnosis import Diagnosis, DiagnosisInputs, fmt, group_by_chunk, span_text
from kvdiff.analysis.latent import value_point
from kvdiff.analysis.rope import estimate_positions
from kvdiff.analysis.storage import EXACT, same_rows, stored_as


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


def diagnose_cache_layers(inputs: DiagnosisInputs) -> list[Diagnosis]:
    al = inputs.comparison.alignment
    points = _kv_points(inputs)
    if not points or len(inputs.comparison.layers) < 2:
        return []
    cached = al.kv_only & al.comparable
    found = _first_bad_layer(inputs, points, cached) if cached.any() else None
    return (_claims(inputs, points, *found) if found is not None else []) + _computed_otherwise(inputs, points)


def _whose(cached: bool) -> str:
    return ("whose K/V came from the cache" if cached else
            "whose K/V the candidate computed from inputs that match the reference's (attn_norm, q, k_pre_rope)")


def _computed_otherwise(inputs: DiagnosisInputs, points: list[str]) -> list[Diagnosis]:
    """At the first layer past the first where k, as attention read it, diverges at computed rows whose
    inputs there match (attn_norm, q, k_pre_rope: RoPE's rules own q and k departing together), the
    accounts that hold exactly (another layer's rows, heads arranged otherwise, K and V swapped, rows
    of other positions, a narrower storage); nothing where none does."""
    al = inputs.comparison.alignment
    if "k" not in points:
        return []
    for row in range(1, len(inputs.comparison.layers)):
        cols = al.computed & al.comparable
        for point in ("attn_norm", "q", "k_pre_rope"):
            ok = inputs.ok(point, row)
            cols &= True if ok is None else ok
        bad = inputs.divergent("k", row)
        cols = np.flatnonzero(cols & (False if bad is None else bad))
        if cols.size:
            return _claims(inputs, points, row, cols, cached=False)
    return []


def explains(inputs: DiagnosisInputs, row: int, cols: np.ndarray) -> bool:
    """Whether the cached rows `cols` at layer row `row` are claimed here (what the cache holds)."""
    points = _kv_points(inputs)
    return bool(points) and bool(_claims(inputs, points, row, cols))


def _claims(inputs: DiagnosisInputs, points: list[str], row: int, cols: np.ndarray,
            cached: bool = True) -> list[Diagnosis]:
    """The accounts of the K/V rows at `cols` of layer row `row` (`cached`: read from the cache, else computed)."""
    layer, before = inputs.comparison.layers[row], inputs.comparison.layers[row - 1]
    source = source_layer(inputs, points, row, cols)
    if source is None:
        return _other_heads(inputs, points, row, cols, before, cached) or \
            _stored_otherwise(inputs, points, row, cols, cached)
    al = inputs.comparison.alignment
    out = []
    for chunk, group in group_by_chunk(inputs, al.positions[cols]):
        gcols = cols[np.isin(al.positions[cols], group)]
        lo, hi = int(group[0]), int(group[-1])
        parts = []
        for point in points:
            max_abs, rel = inputs.worst(point, row, gcols)
            parts.append(f"{point} differs (max_abs {fmt(max_abs)}, rel {fmt(rel)})")
        evidence = (f"layer {layer}, positions {span_text(lo, hi)} {_whose(cached)}: {' and '.join(parts)}"
                    f"{_before(cached, before)}; the candidate's {' and '.join(points)} rows there equal the "
                    f"reference's of layer {source} at the same positions exactly: the cache's layer {layer} holds "
                    f"layer {source}'s K/V (a layer index off where the cache was written or read)")
        proof = (f"{' and '.join(points)} at layer {layer} equal the reference's at layer {source} at all {gcols.size} "
                 f"rows (relative distance <= {EXACT:g}), and differ from its layer {layer} beyond tolerance")
        details = {"layer": layer, "source_layer": source, "source_positions": [int(p) for p in group],
                   "points": points, "rounding": None}
        out.append(Diagnosis("cache_content_mismatch", chunk, (lo, hi), evidence, details, confidence=1.0,
                             proof=proof))
    return out


def _before(cached: bool, before: int) -> str:
    return f" while at layer {before} they match" if cached else ""


def _other_heads(inputs: DiagnosisInputs, points: list[str], row: int, cols: np.ndarray,
                 before: int, cached: bool) -> list[Diagnosis]:
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
        evidence = (f"layer {layer}, positions {span_text(lo, hi)} {_whose(cached)}: "
                    f"{' and '.join(maps)} differ{_before(cached, before)}; each of their KV heads equals one of "
                    f"the reference's heads of this layer exactly, but not its own ({held} rows): the cache's KV heads "
                    f"at layer {layer} are arranged otherwise (a head index off where the cache was written or read)")
        proof = (f"{' and '.join(maps)} at layer {layer}: each candidate head i equals the reference's head "
                 f"head_map[i] (head_map {mapped}) at all {gcols.size} rows (relative distance <= {EXACT:g})")
        details = {"layer": layer, "source_positions": [int(p) for p in group], "points": list(maps),
                   "rounding": None, "head_map": mapped}
        out.append(Diagnosis("cache_content_mismatch", chunk, (lo, hi), evidence, details, confidence=1.0,
                             proof=proof))
    return out


def _stored_otherwise(inputs: DiagnosisInputs, points: list[str], row: int, cols: np.ndarray,
                      cached: bool) -> list[Diagnosis]:
    """Cached rows whose K/V at this layer differ in a way other hidden states do not give: K and V in
    each other's place, one of k and v differing while the other matches (a hidden state moves both),
    or every differing one the reference's in a narrower format, another element order or scaled per
    head. Nothing where both differ and none of that is shown."""
    al, layer = inputs.comparison.alignment, inputs.comparison.layers[row]
    out = []
    for chunk, group in group_by_chunk(inputs, al.positions[cols]):
        gcols = cols[np.isin(al.positions[cols], group)]
        differ = [p for p in points if not inputs.ok(p, row)[gcols].all()]
        details: dict = {"layer": layer, "points": differ, "rounding": None}
        found = []
        moved = _moved_rows(inputs, points, layer, gcols) if len(differ) == 2 else None
        if moved is not None:
            details["source_positions"] = moved
            pairs = ", ".join(f"{p}<-{q}" for p, q in list(zip(group.tolist(), moved))[:6])
            found.append(f"each row's k and v are the reference's rows of this layer at another position exactly "
                         f"({pairs}): rows moved to another slot (a wrong slot, a stale or shifted entry)")
        elif len(differ) == 2 and swapped_kv(inputs, layer, gcols):
            details["swapped_kv"] = True
            found.append("k is the reference's v and v its k at every row, within tolerance: K and V stored in each "
                         "other's place")
        for point in differ if not found else ():
            ref, cand = (rows[gcols] for rows in inputs.rows(layer, point))
            others = {p: inputs.rows(layer, p)[0][gcols] for p in points if p != point}
            if (stored := stored_as(ref, cand, point, others=others)) is not None:
                details.update(stored.details)
                found.append(stored.evidence)
            elif point == "k" and (turn := _rotated_keys(inputs, ref, cand, al.positions[gcols])) is not None:
                details["k_rotation"] = turn
                factor = turn["position_factor"]
                times = f" (RoPE applied {factor} times: each key encoded at {factor} times its position)" if factor else ""
                found.append(f"its k rows are the reference's k of this layer rotated by RoPE to other positions "
                             f"(encoded at {turn['encoded_positions'][0]}..{turn['encoded_positions'][1]}, exact "
                             f"rotations){times}")
        both = moved is not None or "swapped_kv" in details        # one account of k and v together
        if len(found) < len(differ) and len(differ) > 1 and not both or not found and not cached:
            continue
        if len(differ) == 1 and not found and cached:
            other = next(p for p in points if p != differ[0])
            found.append(f"its {differ[0]} rows differ while its {other} rows match: other hidden states would move "
                         f"both, so the {differ[0]} rows were stored or transformed otherwise")
        lo, hi = int(group[0]), int(group[-1])
        evidence = (f"layer {layer}, positions {span_text(lo, hi)} {_whose(cached)}: "
                    + ("they match the reference at the layer before, and " if cached else "")
                    + f"at layer {layer} {' and '.join(differ)} differ: " + "; ".join(found))
        out.append(Diagnosis("cache_content_mismatch", chunk, (lo, hi), evidence, details, confidence=1.0,
                             proof=f"{' and '.join(differ)} divergent at layer {layer} at {gcols.size} rows "
                                   + ("read from the cache; " if cached else "the candidate computed; ")
                                   + "; ".join(found)))
    return out


def _moved_rows(inputs: DiagnosisInputs, points: list[str], layer: int, cols: np.ndarray) -> list[int] | None:
    """Per row, the other position whose reference k and v rows of this layer the candidate's equal
    exactly (v matched, confirmed by k), where every row has one and some is not its own; else None."""
    positions = inputs.comparison.alignment.positions
    (ref_k, cand_k), (ref_v, cand_v) = (inputs.rows(layer, p) for p in points)
    src, dist = sources(ref_v, cand_v[cols], positions, (ref_k, cand_k[cols]))
    if not (dist <= EXACT).all() or (src == positions[cols]).all():
        return None
    return [int(p) for p in src]


def _rotated_keys(inputs: DiagnosisInputs, ref: np.ndarray, cand: np.ndarray, positions: np.ndarray) -> dict | None:
    """The candidate's k rows as the reference's rotated by RoPE to other positions, exactly at every
    row: the encoded positions (first, last) and `position_factor` f where each is f times its own."""
    if inputs.thetas is None or ref.ndim != 3:
        return None
    horizon = 2 * int(positions.max()) + 64
    delta, quality = estimate_positions(ref, cand, inputs.thetas, horizon, -horizon, batch=8)
    if not (quality >= 1 - 1e-4).all() or not delta.any():
        return None
    encoded = positions + delta
    return {"encoded_positions": [int(encoded[0]), int(encoded[-1])], "position_factor": position_factor(encoded, positions)}

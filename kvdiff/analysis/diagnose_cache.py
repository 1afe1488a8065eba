"""cache_content_mismatch: the first layer's K or V differ while their input matches.

In the first layer, k_pre_rope and v are a function of the token's normed embedding alone; if
that input matches and they do not, the candidate read K/V that belong elsewhere (a wrong slot
or block, a stale entry) or were computed or stored otherwise. Where K/V were read from a cache
(no k_pre_rope recorded there), k is tested instead: with v matching, keys whose rotate_half
pairs do not keep the reference's magnitudes are other content, not a rotation (keys.py). The
rows are matched against every reference row to name the source, and against the reference's
rows stored otherwise (storage.py: a narrower format, integers, another element order) to name
how the cache stored them.
"""

from __future__ import annotations

import numpy as np

from kvdiff.analysis.diagnosis import Diagnosis, DiagnosisInputs, fmt, group_by_chunk, runs, span_text
from kvdiff.analysis.keys import CONTENT, ROTATION, SCALED
from kvdiff.analysis.metrics import row_metrics
from kvdiff.analysis.storage import EXACT, same_rows, stored_as

def _distances(ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """Relative distance of each candidate row to each reference row, (cand rows, ref rows); Inf
    where a candidate row holds NaN or Inf, or overflows."""
    r = ref.reshape(ref.shape[0], -1).astype(np.float64)
    c = cand.reshape(cand.shape[0], -1).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        dist = (c * c).sum(1)[:, None] - 2 * c @ r.T + (r * r).sum(1)[None, :]
        rel = np.sqrt(np.maximum(dist, 0) / np.maximum((c * c).sum(1), 1e-300)[:, None])
    rel[~np.isfinite(rel)] = np.inf
    return rel


def sources(ref: np.ndarray, cand: np.ndarray, positions: np.ndarray,
             keys: tuple[np.ndarray, np.ndarray] | None = None, own: np.ndarray | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
    """For each candidate row, the reference position whose row is nearest, and the relative distance.
    Rows of one token are equal wherever it occurs (before RoPE, at the first layer), so with `keys`
    (reference and candidate k rows, rotated at the positions they were computed at) a row is the
    reference's row only where its k is that row's k too: of several exact matches the one whose k
    the candidate holds, and none (distance Inf) where no exact match's k is the candidate's. With
    `own` (the candidate rows' positions) and no keys, of several exact matches the nearest to own."""
    rel = _distances(ref, cand)
    best = rel.argmin(axis=1)
    if own is not None and keys is None:
        exact = rel <= EXACT
        near = np.where(exact, np.abs(positions[None, :] - np.asarray(own)[:, None]), np.iinfo(np.int64).max)
        best = np.where(exact.any(axis=1), near.argmin(axis=1), best)
    if keys is not None:
        exact = rel <= EXACT
        matched = np.flatnonzero(exact.any(1))
        if matched.size:
            k_rel = np.where(exact[matched], _distances(keys[0], keys[1][matched]), np.inf)
            by_key = k_rel.argmin(axis=1)
            settled = k_rel[np.arange(matched.size), by_key] <= EXACT
            best[matched[settled]] = by_key[settled]
            rel[matched[~settled], best[matched[~settled]]] = np.inf
    return positions[best], rel[np.arange(rel.shape[0]), best]


def head_map(ref: np.ndarray, cand: np.ndarray) -> list[int] | None:
    """Rows (n, heads, d) of the same positions: `m` with candidate head i equal to the reference's
    head m[i] in every row (the first such, where heads are equal), where that is not the identity;
    else None (some candidate head equals no reference head, or every head its own)."""
    if ref.ndim != 3 or ref.shape != cand.shape or ref.shape[1] < 2 or not ref.shape[0]:
        return None
    heads, found = ref.shape[1], []
    for i in range(heads):
        match = [j for j in ([i] + [j for j in range(heads) if j != i]) if same_rows(ref[:, j], cand[:, i]).all()]
        if not match:
            return None
        found.append(match[0])
    return found if found != list(range(heads)) else None


def head_order(ref: np.ndarray, cand: np.ndarray) -> list[int] | None:
    """`head_map` where it is a permutation (the heads in another order), else None."""
    found = head_map(ref, cand)
    return found if found is not None and sorted(found) == list(range(ref.shape[1])) else None


def swapped_kv(inputs: DiagnosisInputs, layer: int, cols: np.ndarray) -> bool:
    """The candidate's k rows at `cols` are the reference's v rows and its v rows the reference's k
    rows, within tolerance (the cache's K and V in each other's place)."""
    points = inputs.comparison.points
    if "k" not in points or "v" not in points:
        return False
    (ref_k, cand_k), (ref_v, cand_v) = inputs.rows(layer, "k"), inputs.rows(layer, "v")
    if ref_k.shape[1:] != ref_v.shape[1:] or not cols.size:
        return False
    tolerances = inputs.comparison.tolerances
    return all(row_metrics(a[cols], b[cols]).within(tolerances.for_point(point)).all()
               for a, b, point in ((ref_v, cand_k, "k"), (ref_k, cand_v, "v")))


def _bad_columns(inputs: DiagnosisInputs) -> tuple[np.ndarray, np.ndarray]:
    """Columns with k_pre_rope or v divergent at the first layer with the same input, and columns read
    from a cache whose k is not a rotation of the reference's content while v matches."""
    kp_bad, v_bad = inputs.divergent("k_pre_rope", 0), inputs.divergent("v", 0)
    al = inputs.comparison.alignment
    bad = np.zeros(al.positions.size, bool)
    for b in (kp_bad, v_bad):
        if b is not None:
            bad |= b
    same_input = inputs.ok("attn_norm", 0)
    same_input = inputs.ok("resid_pre", 0) if same_input is None else same_input
    if same_input is not None:
        # Where the K/V were read from a cache no input was recorded; the tokens are the same at
        # every comparable position, and the first layer's input is the token's embedding.
        bad &= same_input | al.kv_only
    keys = inputs.keys
    k_only = np.zeros_like(bad)
    if keys is not None:
        other = (keys.kind == SCALED) | (keys.kind == CONTENT)
        k_only[keys.cols[keys.cached & other]] = True
        # a computed row whose k, as attention read it, is not its own k_pre_rope rotated, where that
        # matches the reference's and k does not, and q does: the key was stored or overwritten otherwise
        # (q departing too is RoPE computing otherwise, rope_mismatch's)
        k_bad, kp_ok, q_bad = inputs.divergent("k", 0), inputs.ok("k_pre_rope", 0), inputs.divergent("q", 0)
        if k_bad is not None and kp_ok is not None:
            computed = keys.cols[~keys.cached & other]
            computed = computed[k_bad[computed] & kp_ok[computed]]
            if q_bad is not None:
                computed = computed[~q_bad[computed]]
            if computed.size:           # a rotation with RoPE's pairs taken otherwise is rope_mismatch's
                computed = computed[inputs.interleaved_keys(computed).kind != ROTATION]
            k_only[computed] = True
    cached = np.array([inputs.chunks.cached(int(p)) is not False for p in al.positions], dtype=bool)
    return np.flatnonzero(((bad & cached) | k_only) & al.comparable), k_only


def _row_sources(inputs: DiagnosisInputs, point: str, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`sources` of the candidate's first-layer `point` rows at `cols`, each confirmed by its key:
    k_pre_rope where the candidate computed the row (its content before RoPE, which the row's own
    position rotates), k as the cache holds it where the row was read from a cache."""
    layer, al = inputs.first_layer, inputs.comparison.alignment
    ref_rows, cand_rows = inputs.rows(layer, point)
    src, dist = np.zeros(cols.size, np.int64), np.zeros(cols.size)
    cached = al.kv_only[cols]
    for rows, key in ((cached, "k"), (~cached, "k_pre_rope")):
        if rows.any():
            keys = None
            if point not in ("k", key) and key in inputs.comparison.points:
                ref_key, cand_key = inputs.rows(layer, key)
                keys = ref_key, cand_key[cols[rows]]
            src[rows], dist[rows] = sources(ref_rows, cand_rows[cols[rows]], al.positions, keys)
    return src, dist


def _prompt_tokens(inputs: DiagnosisInputs, positions: np.ndarray) -> list[int]:
    """The reference's token ids at `positions` (prompt, then generated)."""
    sequence = inputs.sequence
    return [int(sequence[p]) if p < sequence.size else -1 for p in positions]


def _other_tokens(inputs: DiagnosisInputs, cols: np.ndarray) -> tuple[list[int], list[int]] | None:
    """Where every candidate first-layer row at `cols` is some token's K/V computed at some
    position: its v equal to the reference's v of a token (v depends on the token alone) and its k
    that token's key before RoPE rotated exactly to an integer position. The tokens' ids and those
    positions; None where a row is not."""
    layer, positions = inputs.first_layer, inputs.comparison.alignment.positions
    if inputs.thetas is None or not {"k", "k_pre_rope", "v"} <= set(inputs.comparison.points) or not cols.size:
        return None
    ref_v, cand_v = inputs.rows(layer, "v")
    src, dist = sources(ref_v, cand_v[cols], positions)
    if not (dist <= EXACT).all():
        return None
    content = inputs.rows(layer, "k_pre_rope")[0].copy()
    content[cols] = content[np.searchsorted(positions, src)]
    keys = inputs.key_rows_of(content, cols)
    if not ((keys.kind == ROTATION) & keys.exact).all():
        return None
    return _prompt_tokens(inputs, src), [int(e) for e in keys.encoded]


def source_layer(inputs: DiagnosisInputs, points: list[str], row: int, cols: np.ndarray) -> int | None:
    """The other recorded layer whose reference K and V rows the candidate's rows at layer `row` equal
    at the same positions, every one of them; None when no layer does."""
    layers = inputs.comparison.layers
    cand = {p: inputs.rows(layers[row], p)[1][cols] for p in points}
    for other, layer in enumerate(layers):
        if other != row and all(same_rows(inputs.rows(layer, p)[0][cols], cand[p]).all() for p in points):
            return layer
    return None


def diagnose_cache_content(inputs: DiagnosisInputs) -> list[Diagnosis]:
    cols, k_only = _bad_columns(inputs)
    if not cols.size:
        return []
    al, layer, keys = inputs.comparison.alignment, inputs.first_layer, inputs.keys
    positions = al.positions
    out = []
    for chunk, group in group_by_chunk(inputs, positions[cols]):
        sel = np.isin(positions[cols], group)
        gcols = cols[sel]
        lo, hi = int(group[0]), int(group[-1])
        # k where the rows were read from a cache (no k_pre_rope there), or holds other key content
        differing = [name for name in ("k_pre_rope", "v", "k") if inputs.divergent(name, 0) is not None
                     and (inputs.divergent(name, 0)[gcols].any() if name != "k" else
                          k_only[gcols].any() or (inputs.divergent(name, 0) & al.kv_only)[gcols].any())]
        point = "v" if "v" in differing else differing[0]
        ref_rows, cand_rows = inputs.rows(layer, point)
        src, dist = _row_sources(inputs, point, gcols)
        parts = []
        for name in differing:
            max_abs, rel = inputs.worst(name, 0, gcols)
            parts.append(f"{name} differs (max_abs {fmt(max_abs)}, rel {fmt(rel)})")
        where = "whose K/V came from the cache" if any(inputs.chunks.cached(int(p)) for p in group) else \
            "(the trace does not say which positions were cached)"
        same = "the tokens are the same" if al.kv_only[gcols].all() else "the layer input matches"
        evidence = (f"layer {layer}, positions {span_text(lo, hi)} {where}: {' and '.join(parts)} although "
                    f"{same}, and before RoPE these depend on the token alone")
        details: dict = {"layer": layer, "source_positions": [int(s) if d <= EXACT else None for s, d in zip(src, dist)],
                         "points": differing, "rounding": None}
        if group.size != hi - lo + 1:       # rows of the span left out: `source_positions` follows these runs
            details["rows"] = [list(r) for r in runs(group)]
        exact, moved = dist <= EXACT, src != group
        proof = f"{point} at {group.size} rows differs (rel up to {fmt(inputs.worst(point, 0, gcols)[1])}) with {same}"
        swapped = swapped_kv(inputs, layer, gcols)
        stored_otherwise = False        # a branch below names how the rows were stored: no keys' account after it
        if swapped:
            details["swapped_kv"] = True
            evidence += ("; at every one of these positions the candidate's k rows are the reference's v rows and its v "
                         "rows the reference's k rows (within tolerance): the cache holds K and V in each other's place")
            proof += "; k = the reference's v and v = the reference's k at every row, within tolerance"
        elif (other_layer := source_layer(inputs, ["k", "v"], 0, gcols)) is not None:
            details["source_layer"] = other_layer
            stored_otherwise = True
            evidence += (f"; the candidate's k and v rows there equal the reference's of layer {other_layer} at the same "
                         f"positions exactly: the cache's layer {layer} holds layer {other_layer}'s K/V (a layer index off "
                         f"where the cache was written or read)")
            proof += f"; k and v equal the reference's at layer {other_layer} at every row (relative distance <= {EXACT:g})"
        elif (exact & moved).any():
            pairs = ", ".join(f"{p}<-{s}" for p, s in zip(group[exact & moved][:6], src[exact & moved][:6]))
            proof += f"; {int((exact & moved).sum())} rows equal the reference's {point} at other positions exactly"
            evidence += f"; the candidate's {point} rows equal the reference's at other positions ({pairs}): a wrong slot or stale entry"
        elif point == "v" and (other := _other_tokens(inputs, gcols)) is not None:
            tokens, at = other
            details["other_tokens"], details["computed_at"] = tokens, at
            shown = ", ".join(f"{p}: {inputs.token_text(t)!r} at {e} for {inputs.token_text(w)!r}"
                              for p, t, e, w in zip(group[:6], tokens, at, _prompt_tokens(inputs, group)))
            where = "its own position" if at == group.tolist() else "the position named"
            evidence += (f"; each of these rows is another token's K/V: its v is the reference's v of that token (v "
                         f"depends on the token alone) and its k that token's key rotated exactly to {where} ({shown}): "
                         f"rows computed for other tokens, of another request or sequence, read in this one's place (a "
                         f"stale slot, a block freed while still cached, a prefix match that counted too far)")
            proof += "; v = the reference's v of another token and k = its key rotated to an integer position, at every row"
        elif (order := head_order(ref_rows[gcols], cand_rows[gcols])) is not None:
            details["head_order"] = order
            stored_otherwise = True
            evidence += (f"; at every one of these positions the candidate's {point} rows hold the reference's heads in "
                         f"the order {order}: the cache's head layout differs")
            proof += f"; every row's heads equal the reference's heads {order} exactly"
        elif (stored := stored_as(ref_rows[gcols], cand_rows[gcols], point, uniform_scale=point != "k")) is not None:
            details.update(stored.details)      # a k scaled alike in every head: k_scale's, below
            stored_otherwise = True
            evidence += f"; {stored.evidence}"
            proof += f"; {stored.proof}"
        empty = {name: ~inputs.rows(layer, name)[1][gcols].reshape(gcols.size, -1).any(axis=1)
                 for name in ("k", "v") if name in differing}
        zero = [name for name, rows in empty.items() if rows.all()]
        some = {name: group[rows].tolist() for name, rows in empty.items() if rows.any() and not rows.all()}
        if some:
            details["zero_row_positions"] = some
            evidence += "; " + "; ".join(f"the candidate's {name} rows at {', '.join(map(str, at[:6]))} are all zeros: "
                                         f"slots never written" for name, at in some.items())
            proof += "; " + "; ".join(f"{name} rows at {len(at)} positions are zero" for name, at in some.items())
        if zero:
            details["zero_rows"] = zero
            evidence += (f"; the candidate's {' and '.join(zero)} rows there are all zeros: cache slots never written, "
                         f"or an empty block read in their place")
            proof += f"; every {'/'.join(zero)} row is zero"
        if k_only[gcols].any() and keys is not None and not swapped and not stored_otherwise:
            ksel = np.isin(keys.cols, gcols)
            scaled = keys.kind[ksel] == SCALED
            if scaled.all() and keys.exact[ksel].all() and (keys.encoded[ksel] == positions[keys.cols[ksel]]).all():
                factor = float(np.median(keys.factor[ksel]))
                details["k_scale"] = factor
                evidence += (f"; the cached keys are the reference's rotated to the expected positions and scaled by "
                             f"{fmt(factor)} (every rotate_half pair), while v matches: their k projection (or k-norm) "
                             f"differed when they were computed")
            elif al.kv_only[gcols].all():
                evidence += ("; the cached keys' rotate_half pairs do not keep the reference's magnitudes, so no RoPE "
                             "rotation makes them the reference's keys, while v matches: they were computed otherwise "
                             "(k projection, k-norm)")
            else:
                evidence += ("; at the rows the candidate computed, k as attention read it is not the row's own "
                             "k_pre_rope rotated (which matches the reference's): the key was stored or overwritten "
                             "otherwise after it was computed")
            proof += (f"; k's pair magnitudes differ from the reference's k_pre_rope by up to "
                      f"{fmt(float(keys.magnitude_rel[ksel].max()))} of the largest, beyond tolerance")
        out.append(Diagnosis("cache_content_mismatch", chunk, (lo, hi), evidence, details, confidence=1.0, proof=proof))
    return out

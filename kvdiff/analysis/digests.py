"""Digest traces: the comparison of every row from its digest, with the zoom window's rows over it.

Outside the window a row is known by its hash and two statistics (trace/digest.py). Equal hashes
are `bitwise`. Different hashes are `divergent` when the statistics prove it, else `different`
(the bits differ; by how much is known only in the window). The proof: for rows x, y,
max|x - y| >= | max|x| - max|y| | and max|x - y| >= rms(x - y) >= | rms(x) - rms(y) |, so the
larger of the two gaps, less the float32 rounding of the stored statistics, is a lower bound of
max_abs; beyond the tolerance's bound at the reference's scale it is a breach. `max_abs` and
`rel` of such cells are those lower bounds (rel >= (rms(x) - rms(y))^2 / (rms(x)^2 + rms(y)^2)).
A row is `bitwise` only where the statistics agree too: equal hashes of rows whose statistics prove
them different (a 2^-32 hash collision, or a trace edited by hand) are compared by the statistics.
"""

from __future__ import annotations

import numpy as np
import torch

from kvdiff.analysis.align import Alignment
from kvdiff.analysis.compare import Comparison, PointMap
from kvdiff.analysis.tolerance import NOT_COMPARED, Tier, Tolerances
from kvdiff.errors import TraceError
from kvdiff.trace import TraceReader
from kvdiff.trace.digest import row_digests
from kvdiff.trace.points import FINAL_POINTS, KNOWN_LAYER_POINTS, READ_POINTS

_STORED = 2.0 ** -23      # float32 rounding of a stored statistic, relative, with a factor 2 to spare


def _digest_map(ref: TraceReader, cand: TraceReader, point: str, layers: list[int | None], alignment: Alignment,
                tolerances: Tolerances) -> PointMap:
    """One point's map over `layers` x the aligned positions, from the digests alone."""
    al = alignment
    out = PointMap.empty(point, layers, al.positions)
    tolerance = tolerances.for_point(point)
    recorded = np.ones(al.positions.size, bool) if point in READ_POINTS and layers[0] is not None else al.computed
    for row, layer in enumerate(layers):
        (ref_hash, x), (cand_hash, y) = ref.digests(layer, point, al.ref_index), cand.digests(layer, point, al.cand_index)
        x, y = x.astype(np.float64), y.astype(np.float64)
        finite_x, finite_y = np.isfinite(x).all(1), np.isfinite(y).all(1)
        with np.errstate(invalid="ignore", over="ignore"):
            slack = _STORED * np.maximum(np.abs(x), np.abs(y)).max(1)
            gap = np.maximum(np.abs(x[:, 0] - y[:, 0]), np.abs(x[:, 1] - y[:, 1])) - slack
            squares = x[:, 0] ** 2 + y[:, 0] ** 2
            rel = np.where(squares > 0, np.maximum(np.abs(x[:, 0] - y[:, 0]) - slack, 0) ** 2
                           / np.where(squares > 0, squares, 1), 0.0)
            breach = gap > tolerance.bound(x[:, 1] * (1 + _STORED))
        # the statistics are a proof, equal hashes only near-certain evidence: the proof wins
        same = (ref_hash == cand_hash) & ~(gap > 0) & (finite_x == finite_y)
        tier = np.where(same, Tier.BITWISE, np.where(breach | ~(finite_x & finite_y), Tier.DIVERGENT, Tier.DIFFERENT))
        out.tier[row] = np.where(recorded, np.where(al.comparable, tier, Tier.INCOMPARABLE), NOT_COMPARED)
        out.max_abs[row] = np.where(recorded, np.where(same, 0.0, np.maximum(gap, 0.0)), np.nan)
        out.rel[row] = np.where(recorded, np.where(same, 0.0, rel), np.nan)
        out.ref_finite[row], out.cand_finite[row] = finite_x | ~recorded, finite_y | ~recorded
    return out


def digest_comparison(ref: TraceReader, cand: TraceReader, alignment: Alignment,
                      tolerances: Tolerances) -> Comparison:
    """Every digested row of both traces compared by its digest (`alignment` over digest positions)."""
    layers = [i for i in ref.meta.digest_layers if i in set(cand.meta.digest_layers)]
    shared = [p for p in ref.meta.digest_points if p in cand.meta.digest_points]
    points = [p for p in KNOWN_LAYER_POINTS if p in shared] if layers else []
    return Comparison(alignment, tolerances, layers if points else [],
                      {p: _digest_map(ref, cand, p, layers, alignment, tolerances) for p in points},
                      {p: _digest_map(ref, cand, p, [None], alignment, tolerances)
                       for p in FINAL_POINTS if p in shared}, last_layer=ref.meta.dims.num_layers - 1)


def _statistics_agree(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per row, whether two digests' statistics (rows, 2) describe the same row: equal, both NaN, or
    apart by no more than their float32 rounding (each statistic on its own scale)."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    with np.errstate(invalid="ignore"):
        agree = (x == y) | (np.isnan(x) & np.isnan(y)) | (np.abs(x - y) <= _STORED * np.maximum(np.abs(x), np.abs(y)))
    return agree.all(1)


def check_window(trace: TraceReader) -> None:
    """Refuse a digest trace whose zoom window holds a row that does not match the trace's own
    digest of it, its hash or (beyond the stored rounding) its statistics: the row or its digest
    was damaged or edited, or recorded apart. A diff of the window would show a difference no run
    made; statistics that do not describe their rows would prove breaches outside it."""
    meta = trace.meta
    at = np.searchsorted(trace.digest_positions, trace.positions)
    computed = np.flatnonzero(~np.isin(trace.positions, np.union1d(meta.kv_only_positions, meta.key_only_positions)))
    wanted = [(layer, p) for layer in meta.layers if layer in meta.digest_layers
              for p in meta.points if p in KNOWN_LAYER_POINTS and p in meta.digest_points]
    wanted += [(None, p) for p in meta.points if p in FINAL_POINTS and p in meta.digest_points]
    for layer, point in wanted:
        rows = np.arange(trace.positions.size) if point in READ_POINTS else computed
        if not rows.size:
            continue
        hashed, stats = row_digests(torch.from_numpy(np.ascontiguousarray(trace.point(layer, point, rows))))
        stored_hash, stored_stats = trace.digests(layer, point, at[rows])
        differs = np.flatnonzero((hashed.numpy() != stored_hash) | ~_statistics_agree(stats.numpy(), stored_stats))
        if differs.size:
            where = point if layer is None else f"{point} of layer {layer}"
            raise TraceError(f"trace {trace.path} is damaged: its row of {where} at position "
                             f"{int(trace.positions[rows[differs[0]]])} does not match its digest of that row "
                             f"(rows of it that do not: {differs.size}): record it again")


def _overlay_map(whole: PointMap, window: PointMap) -> None:
    """Copy the window's cells (exact metrics from full rows) into `whole`, where it has them."""
    cols = np.searchsorted(whole.positions, window.positions)
    inside = (cols < whole.positions.size) & (whole.positions[np.minimum(cols, whole.positions.size - 1)]
                                              == window.positions) if whole.positions.size else cols < 0
    for w_row, layer in enumerate(window.layers):
        if layer not in whole.layers:
            continue
        row = whole.row_of(layer)
        known = inside & (window.tier[w_row] != NOT_COMPARED)
        target = cols[known]
        for name in ("tier", "max_abs", "rel", "cosine", "ref_finite", "cand_finite"):
            getattr(whole, name)[row, target] = getattr(window, name)[w_row, known]


def with_window(whole: Comparison, window: Comparison) -> Comparison:
    """`whole` (from digests) with the zoom window's exact cells written over it."""
    for maps, window_maps in ((whole.points, window.points), (whole.final, window.final)):
        for point, pmap in window_maps.items():
            if point in maps:
                _overlay_map(maps[point], pmap)
    whole.norms = window.norms
    whole.bytes_compared += window.bytes_compared
    return whole


def first_digest_mismatch(a: TraceReader, b: TraceReader) -> tuple[int | None, str, int] | None:
    """The first (layer, point, position), layer by layer, where two digest traces of the same
    run hold different digests: hashes, or statistics beyond their stored rounding (a hash
    collision hides no difference the statistics show); or one holds a position the other lacks.
    None when they agree."""
    if not np.array_equal(a.digest_positions, b.digest_positions):
        return None, "positions", int(np.setxor1d(a.digest_positions, b.digest_positions)[0])
    layers = [i for i in a.meta.digest_layers if i in b.meta.digest_layers]
    points = [p for p in a.meta.digest_points if p in b.meta.digest_points]
    for layer in [*layers, None]:
        for point in points:
            if (point in FINAL_POINTS) != (layer is None):
                continue
            (hash_a, stats_a), (hash_b, stats_b) = a.digests(layer, point), b.digests(layer, point)
            differs = np.flatnonzero((hash_a != hash_b) | ~_statistics_agree(stats_a, stats_b))
            if differs.size:
                return layer, point, int(a.digest_positions[differs[0]])
    return None

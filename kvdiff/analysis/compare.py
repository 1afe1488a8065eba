"""Stage 2: compare aligned rows layer by layer, keeping only per-row scalars.

Each layer (and then the final points) of both traces is read in blocks of aligned rows of about
a quarter of one layer's data (capped at 8 MB) per trace, compared point by point and dropped
before the next block is read, so memory stays under two layers' data whatever the trace length
or vocabulary. The norm checks ride along: they need each block's norm inputs and outputs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from kvdiff.analysis.align import Alignment
from kvdiff.analysis.metrics import RowMetrics, row_metrics
from kvdiff.analysis.norms import NORM_IO, NormCheck, NormChecker
from kvdiff.analysis.tolerance import NOT_COMPARED, Tier, Tolerances
from kvdiff.trace.points import FINAL_POINTS, KNOWN_LAYER_POINTS, READ_POINTS
from kvdiff.trace import TraceReader

log = logging.getLogger(__name__)

_BLOCK_BYTES = (64 << 10, 8 << 20)   # rows read at once from each trace: a quarter layer, within these bounds
_HDF5_CHUNK_ROWS = 128                # the writer's chunk height for rows of 64 B to 8 KB (a multiple below)


@dataclass
class PointMap:
    """One probe point's metrics over (layers x aligned positions); layer None for final points."""

    point: str
    layers: list[int | None]
    positions: np.ndarray
    tier: np.ndarray       # int8 (L, P): Tier values, NOT_COMPARED where a trace lacks the point
    max_abs: np.ndarray    # float64 (L, P), NaN where not compared
    rel: np.ndarray
    cosine: np.ndarray
    ref_finite: np.ndarray   # bool (L, P)
    cand_finite: np.ndarray

    @classmethod
    def empty(cls, point: str, layers: list[int | None], positions: np.ndarray) -> "PointMap":
        shape = (len(layers), positions.size)
        nan = np.full(shape, np.nan)
        return cls(point, layers, positions, np.full(shape, NOT_COMPARED, dtype=np.int8), nan, nan.copy(),
                   nan.copy(), np.ones(shape, bool), np.ones(shape, bool))

    def fill(self, row: int, cols: slice, metrics: RowMetrics, tiers: np.ndarray, comparable: np.ndarray,
             recorded: np.ndarray) -> None:
        """Layer row `row`, aligned positions `cols`; `comparable` and `recorded` (both traces hold
        a row of this point there) are masks of those positions."""
        self.tier[row, cols] = np.where(recorded, np.where(comparable, tiers, Tier.INCOMPARABLE), NOT_COMPARED)
        for out, values in ((self.max_abs, metrics.max_abs), (self.rel, metrics.rel), (self.cosine, metrics.cosine)):
            out[row, cols] = np.where(recorded, values, np.nan)
        self.ref_finite[row, cols] = metrics.ref_finite | ~recorded
        self.cand_finite[row, cols] = metrics.cand_finite | ~recorded

    def row_of(self, layer: int | None) -> int:
        return self.layers.index(layer)


@dataclass
class Comparison:
    """Everything the search and the diagnoses need, as small per-row arrays."""

    alignment: Alignment
    tolerances: Tolerances
    layers: list[int]
    points: dict[str, PointMap]                 # layer points
    final: dict[str, PointMap]                  # final points (one row, layer None)
    norms: list[NormCheck] = field(default_factory=list)
    bytes_compared: int = 0
    last_layer: int | None = None               # the model's last layer (the final norm's input), where known


def _row_nbytes(ref: TraceReader, cand: TraceReader, layer: int | None, points: Sequence[str]) -> int:
    """Bytes of one aligned row of `points` of `layer` as read from the larger of the two traces."""
    return sum(max(ref.row_nbytes(layer, p), cand.row_nbytes(layer, p)) for p in points)


def _blocks(n: int, row_bytes: int, block_bytes: int) -> list[slice]:
    """Slices of `n` aligned rows of about `block_bytes` each (whole HDF5 chunks of rows when they fit)."""
    step = max(1, block_bytes // max(1, row_bytes))
    if step >= _HDF5_CHUNK_ROWS:
        step -= step % _HDF5_CHUNK_ROWS
    return [slice(lo, min(n, lo + step)) for lo in range(0, max(n, 1), step)]


def _read_blocks(ref: TraceReader, cand: TraceReader, alignment: Alignment, layer: int | None,
                 points: Sequence[str], block_bytes: int,
                 ) -> Iterator[tuple[slice, dict[str, np.ndarray], dict[str, np.ndarray]]]:
    """Block by block of aligned positions: the columns, and `points` of `layer` in each trace there."""
    for cols in _blocks(alignment.positions.size, _row_nbytes(ref, cand, layer, points), block_bytes):
        ri, ci = alignment.ref_index[cols], alignment.cand_index[cols]
        yield cols, {p: ref.point(layer, p, ri) for p in points}, {p: cand.point(layer, p, ci) for p in points}


def _fill(out: Comparison, pmap: PointMap, row: int, cols: slice, x: np.ndarray, y: np.ndarray) -> None:
    """Compare a block of aligned rows into `pmap` and count the bytes compared."""
    out.bytes_compared += x.nbytes + y.nbytes
    metrics = row_metrics(x, y)
    al = out.alignment
    recorded = np.ones(x.shape[0], dtype=bool) if pmap.point in READ_POINTS else al.computed[cols]
    pmap.fill(row, cols, metrics, metrics.tiers(out.tolerances.for_point(pmap.point)), al.comparable[cols], recorded)


def _compare_layer(ref: TraceReader, cand: TraceReader, out: Comparison, row: int, layer: int,
                   block_bytes: int) -> None:
    shared = list(out.points)
    checkers = {norm: NormChecker(ref, cand, layer, norm, out.tolerances)
                for norm, (src, dst) in NORM_IO.items() if src in out.points and dst in out.points}
    for cols, a, b in _read_blocks(ref, cand, out.alignment, layer, shared, block_bytes):
        for norm, checker in checkers.items():
            src, dst = NORM_IO[norm]
            checker.add((a[src], a[dst]), (b[src], b[dst]))
        for point in shared:
            _fill(out, out.points[point], row, cols, a.pop(point), b.pop(point))
    ref_stats, cand_stats = ref.norm_stats(layer), cand.norm_stats(layer)
    out.norms += [c.finish(ref_stats.get(norm), cand_stats.get(norm), out.alignment) for norm, c in checkers.items()]


def _compare_final(ref: TraceReader, cand: TraceReader, out: Comparison, block_bytes: int) -> None:
    """The final points; the final norm's check reads the model's last layer's resid_post block by
    block, where both traces hold that layer (a zoom trace or `--layers` may stop before it)."""
    last = ref.meta.dims.num_layers - 1
    last = last if last in out.layers and "resid_post" in out.points else None
    checker = NormChecker(ref, cand, None, "final_norm", out.tolerances) \
        if last is not None and "final_norm" in out.final else None
    al = out.alignment
    for cols, a, b in _read_blocks(ref, cand, al, None, list(out.final), block_bytes):
        if checker is not None:
            checker.add((ref.point(last, "resid_post", al.ref_index[cols]), a["final_norm"]),
                        (cand.point(last, "resid_post", al.cand_index[cols]), b["final_norm"]))
        for point, pmap in out.final.items():
            _fill(out, pmap, 0, cols, a.pop(point), b.pop(point))
    if checker is not None:
        out.norms.append(checker.finish(ref.norm_stats(None).get("final_norm"),
                                        cand.norm_stats(None).get("final_norm"), al))


def compare(ref: TraceReader, cand: TraceReader, alignment: Alignment, tolerances: Tolerances) -> Comparison:
    """Stream both traces layer by layer, in row blocks, and fill the point maps and norm checks."""
    layers = [i for i in ref.meta.layers if i in set(cand.meta.layers)]
    shared = [p for p in KNOWN_LAYER_POINTS if p in ref.meta.points and p in cand.meta.points] if layers else []
    layers = layers if shared else []          # a trace of final points only holds no layer groups
    pos = alignment.positions
    out = Comparison(alignment, tolerances, layers,
                     {p: PointMap.empty(p, list(layers), pos) for p in shared},
                     {p: PointMap.empty(p, [None], pos) for p in FINAL_POINTS
                      if p in ref.meta.points and p in cand.meta.points}, last_layer=ref.meta.dims.num_layers - 1)
    layer_bytes = pos.size * _row_nbytes(ref, cand, layers[0], shared) if layers else 0
    block_bytes = min(max(layer_bytes // 4, _BLOCK_BYTES[0]), _BLOCK_BYTES[1])
    for row, layer in enumerate(layers):
        _compare_layer(ref, cand, out, row, layer, block_bytes)
        log.debug("layer %d compared", layer)
    if out.final:
        _compare_final(ref, cand, out, block_bytes)
    return out

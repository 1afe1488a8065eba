"""Stage 2: compare aligned rows layer by layer, keeping only per-row scalars.

Each layer of both traces is read, compared point by point and dropped before the next layer
is read, so memory stays near two layers' data whatever the trace size. The norm checks ride
along: they need each layer's norm inputs and outputs while they are loaded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from kvdiff.analysis.align import Alignment
from kvdiff.analysis.metrics import RowMetrics, row_metrics
from kvdiff.analysis.norms import NormCheck, check_norm
from kvdiff.analysis.tolerance import NOT_COMPARED, Tier, Tolerances
from kvdiff.probes.points import FINAL_POINTS, LAYER_POINTS
from kvdiff.probes.trace import TraceReader

log = logging.getLogger(__name__)

# Each norm's input point and output point, per layer; the final norm reads the last resid_post.
NORM_IO = {"attn_norm": ("resid_pre", "attn_norm"), "mlp_norm": ("resid_mid", "mlp_norm")}


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

    def fill(self, row: int, metrics: RowMetrics, tiers: np.ndarray, comparable: np.ndarray) -> None:
        self.tier[row] = np.where(comparable, tiers, Tier.INCOMPARABLE)
        self.max_abs[row], self.rel[row], self.cosine[row] = metrics.max_abs, metrics.rel, metrics.cosine
        self.ref_finite[row], self.cand_finite[row] = metrics.ref_finite, metrics.cand_finite

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


def _take(rows: np.ndarray, index: np.ndarray) -> np.ndarray:
    """rows[index], without a copy when the index is every row in order."""
    if index.size == rows.shape[0] and (index.size == 0 or (index[0] == 0 and index[-1] == index.size - 1)):
        return rows
    return rows[index]


def compare(ref: TraceReader, cand: TraceReader, alignment: Alignment, tolerances: Tolerances) -> Comparison:
    """Stream both traces layer by layer and fill the point maps and norm checks."""
    layers = [i for i in ref.meta.layers if i in set(cand.meta.layers)]
    shared = [p for p in LAYER_POINTS if p in ref.meta.points and p in cand.meta.points] if layers else []
    layers = layers if shared else []          # a trace of final points only holds no layer groups
    pos = alignment.positions
    comparable = alignment.comparable
    out = Comparison(alignment, tolerances, layers,
                     {p: PointMap.empty(p, list(layers), pos) for p in shared},
                     {p: PointMap.empty(p, [None], pos) for p in FINAL_POINTS
                      if p in ref.meta.points and p in cand.meta.points})
    ri, ci = alignment.ref_index, alignment.cand_index
    last_resid: tuple[np.ndarray, np.ndarray] | None = None
    for row, layer in enumerate(layers):
        a, b = ref.layer(layer), cand.layer(layer)
        ref_stats, cand_stats = ref.norm_stats(layer), cand.norm_stats(layer)
        for norm, (src, dst) in NORM_IO.items():
            if src in a and dst in a and src in b and dst in b:
                out.norms.append(check_norm(
                    ref, cand, layer, norm, (a[src][ri], a[dst][ri]), (b[src][ci], b[dst][ci]),
                    ref_stats.get(norm), cand_stats.get(norm), alignment, tolerances))
        if layer == layers[-1] and "resid_post" in a and "resid_post" in b:
            last_resid = (a["resid_post"][ri], b["resid_post"][ci])
        for point in shared:
            x, y = _take(a.pop(point), ri), _take(b.pop(point), ci)
            out.bytes_compared += x.nbytes + y.nbytes
            metrics = row_metrics(x, y)
            out.points[point].fill(row, metrics, metrics.tiers(tolerances.for_point(point)), comparable)
        del a, b
        log.debug("layer %d compared", layer)
    if out.final:
        a, b = ref.final(), cand.final()
        if last_resid is not None and "final_norm" in a and "final_norm" in b:
            out.norms.append(check_norm(
                ref, cand, None, "final_norm", (last_resid[0], a["final_norm"][ri]),
                (last_resid[1], b["final_norm"][ci]), ref.norm_stats(None).get("final_norm"),
                cand.norm_stats(None).get("final_norm"), alignment, tolerances))
        for point, pmap in out.final.items():
            x, y = _take(a.pop(point), ri), _take(b.pop(point), ci)
            out.bytes_compared += x.nbytes + y.nbytes
            metrics = row_metrics(x, y)
            pmap.fill(0, metrics, metrics.tiers(tolerances.for_point(point)), comparable)
    return out

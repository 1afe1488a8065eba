"""Stage 3: the first place where the traces part, in dataflow order.

Order: position first (a token's computation only reads earlier positions), then layer (final
points after every layer), then the probe point's rank inside the layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvdiff.analysis.chunks import ChunkLookup
from kvdiff.analysis.compare import Comparison, PointMap
from kvdiff.analysis.tolerance import Tier
from kvdiff.trace.points import POINT_ORDER


@dataclass(frozen=True)
class Location:
    """A (layer, position, point) with its tier and metrics; layer None for final points."""

    layer: int | None
    position: int
    tensor: str
    chunk: str | None
    tier: str
    max_abs: float | None
    rel: float | None
    cosine: float | None

    def to_json(self) -> dict:
        return {"layer": self.layer, "position": self.position, "tensor": self.tensor, "chunk": self.chunk,
                "tier": self.tier, "max_abs": _num(self.max_abs), "rel": _num(self.rel), "cosine": _num(self.cosine)}


def _num(v: float | None) -> float | None:
    return None if v is None or not np.isfinite(v) else float(v)


def all_maps(comparison: Comparison) -> list[PointMap]:
    return list(comparison.points.values()) + list(comparison.final.values())


def location(comparison: Comparison, chunks: ChunkLookup, pmap: PointMap, row: int, col: int) -> Location:
    """The Location of one cell of a point map (tier "not compared" where one side holds no row)."""
    tier = int(pmap.tier[row, col])
    return Location(
        layer=pmap.layers[row], position=int(pmap.positions[col]), tensor=pmap.point,
        chunk=chunks.chunk_of(int(pmap.positions[col])), tier=Tier(tier).label if tier >= 0 else "not compared",
        max_abs=_num(pmap.max_abs[row, col]), rel=_num(pmap.rel[row, col]), cosine=_num(pmap.cosine[row, col]))


def dataflow_key(comparison: Comparison, position: int, layer: int | None, point: str) -> tuple[int, int, int]:
    """Where a cell comes in dataflow order (the module's order: position, layer, point)."""
    return position, len(comparison.layers) if layer is None else comparison.layers.index(layer), POINT_ORDER[point]


def first_where(comparison: Comparison, chunks: ChunkLookup,
                hit: Callable[[PointMap], np.ndarray]) -> Location | None:
    """The first cell, in dataflow order, where `hit(map)` (a bool (L, P) array) holds."""
    best: tuple | None = None
    for pmap in all_maps(comparison):
        mask = hit(pmap)
        cols = np.flatnonzero(mask.any(axis=0))
        if not cols.size:
            continue
        col = int(cols[0])
        row = int(np.flatnonzero(mask[:, col])[0])
        key = dataflow_key(comparison, int(pmap.positions[col]), pmap.layers[row], pmap.point)
        if best is None or key < best[0]:
            best = (key, pmap, row, col)
    return None if best is None else location(comparison, chunks, best[1], best[2], best[3])


def bits_differ(pmap: PointMap) -> np.ndarray:
    """The cells whose bits differ: noise, divergent, or (a digest trace's) different."""
    return (pmap.tier == Tier.NOISE) | (pmap.tier == Tier.DIVERGENT) | (pmap.tier == Tier.DIFFERENT)


def first_bit_difference(comparison: Comparison, chunks: ChunkLookup) -> Location | None:
    return first_where(comparison, chunks, bits_differ)


def breaches_tolerance(pmap: PointMap) -> np.ndarray:
    """The cells that breach tolerance (divergent)."""
    return pmap.tier == Tier.DIVERGENT


def first_tolerance_breach(comparison: Comparison, chunks: ChunkLookup) -> Location | None:
    return first_where(comparison, chunks, breaches_tolerance)


LARGE_REL = 1e-3     # rel (squared norms' ratio) of a difference no rounding makes: about 4.5% of a row's norm


def first_large_divergence(comparison: Comparison, chunks: ChunkLookup, first: Location | None) -> Location | None:
    """Where the first breach (`first`) is small (rel below LARGE_REL, the size of a narrower format's
    rounding), the first cell beyond tolerance by far more (rel at least LARGE_REL): a second cause a
    rounding-sized first breach may hide; else None."""
    if first is None or first.rel is None or not first.rel < LARGE_REL:
        return None
    return first_where(comparison, chunks, lambda pmap: breaches_tolerance(pmap) & (pmap.rel >= LARGE_REL))


def first_non_finite(comparison: Comparison, chunks: ChunkLookup) -> Location | None:
    return first_where(comparison, chunks, lambda m: (m.tier != Tier.INCOMPARABLE) & (m.tier >= 0)
                       & ~(m.ref_finite & m.cand_finite))

"""Per-row difference metrics between a reference and a candidate capture.

Rows are flattened to vectors: one row is one token's tensor at one probe point. The relative
difference ``rel = 1 - 2*sum(xy)/(sum(x^2)+sum(y^2))`` is computed in its algebraically equal,
cancellation-free form ``sum((x-y)^2)/(sum(x^2)+sum(y^2))`` with float64 accumulation, so it is
exact to a few ulps even for rows that differ in their last bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvdiff.analysis.tolerance import Tier, Tolerance


@dataclass(frozen=True)
class RowMetrics:
    """Metrics of n aligned rows; NaN where undefined (e.g. both rows all-zero for cosine)."""

    max_abs: np.ndarray   # float64 (n,)
    rel: np.ndarray       # float64 (n,)
    cosine: np.ndarray    # float64 (n,)
    scale: np.ndarray     # float64 (n,) largest |reference| in the row
    bitwise: np.ndarray   # bool (n,) same bits in every element
    ref_finite: np.ndarray   # bool (n,) reference row free of NaN / Inf
    cand_finite: np.ndarray  # bool (n,) candidate row free of NaN / Inf

    @property
    def finite(self) -> np.ndarray:
        return self.ref_finite & self.cand_finite

    def tiers(self, tolerance: Tolerance) -> np.ndarray:
        """Tier per row (int8): bitwise, noise (within `tolerance`), divergent (incl. non-finite)."""
        within = self.finite & (self.max_abs <= tolerance.bound(self.scale))
        out = np.full(self.max_abs.shape, Tier.DIVERGENT, dtype=np.int8)
        out[within] = Tier.NOISE
        out[self.bitwise] = Tier.BITWISE
        return out

    def within(self, tolerance: Tolerance) -> np.ndarray:
        """Bool per row: bitwise equal or within `tolerance` (tier noise or better)."""
        return self.tiers(tolerance) <= Tier.NOISE


def _rowsum64(a: np.ndarray) -> np.ndarray:
    return np.add.reduce(a, axis=1, dtype=np.float64)


_BLOCK_BYTES = 1 << 18     # rows are processed in cache-sized blocks: bounded temporaries, fewer misses


def _block(x: np.ndarray, y: np.ndarray, out: dict[str, np.ndarray], lo: int, hi: int) -> None:
    bits = np.uint64 if x.dtype == np.float64 else np.uint32
    out["bitwise"][lo:hi] = (x.view(bits) == y.view(bits)).all(axis=1)
    d = x - y
    ad = np.abs(d)
    out["max_abs"][lo:hi] = ad.max(axis=1, initial=0.0)
    out["scale"][lo:hi] = np.abs(x).max(axis=1, initial=0.0)
    out["cand_max"][lo:hi] = np.abs(y).max(axis=1, initial=0.0)
    np.multiply(d, d, out=d)
    out["dd"][lo:hi] = _rowsum64(d)
    np.multiply(x, x, out=ad)
    out["xx"][lo:hi] = _rowsum64(ad)
    np.multiply(y, y, out=ad)
    out["yy"][lo:hi] = _rowsum64(ad)
    np.multiply(x, y, out=ad)
    out["xy"][lo:hi] = _rowsum64(ad)


def _outputs(n: int) -> dict[str, np.ndarray]:
    """Zeroed per-row accumulators that `_block` fills."""
    out = {k: np.zeros(n) for k in ("max_abs", "scale", "cand_max", "dd", "xx", "yy", "xy")}
    out["bitwise"] = np.zeros(n, dtype=bool)
    return out


def row_metrics(reference: np.ndarray, candidate: np.ndarray) -> RowMetrics:
    """Metrics of rows `reference[i]` vs `candidate[i]`; arrays (n, ...) of float dtypes (upcast to
    the wider of float32 and float64)."""
    if reference.shape != candidate.shape:
        raise ValueError(f"shape mismatch {reference.shape} vs {candidate.shape}")
    n, width = reference.shape[0], int(np.prod(reference.shape[1:], dtype=np.int64))
    dtype = np.float64 if np.float64 in (reference.dtype, candidate.dtype) else np.float32   # traces may differ
    x = np.ascontiguousarray(reference, dtype=dtype).reshape(n, width)
    y = np.ascontiguousarray(candidate, dtype=dtype).reshape(n, width)
    out = _outputs(n)
    step = max(1, _BLOCK_BYTES // max(1, x.shape[1] * x.itemsize))
    with np.errstate(invalid="ignore", over="ignore"):
        for lo in range(0, n, step):
            _block(x[lo:lo + step], y[lo:lo + step], out, lo, min(n, lo + step))
        ref_finite, cand_finite = np.isfinite(out["scale"]), np.isfinite(out["cand_max"])
        finite = ref_finite & cand_finite
        # Squares of finite elements beyond ~1e19 (float32) overflow; rel and cosine do not depend
        # on scale, so those rows are summed again divided by their largest element.
        redo = np.flatnonzero(finite & ~np.isfinite(out["dd"] + out["xx"] + out["yy"]))
        if redo.size:
            s = np.maximum(out["scale"][redo], out["cand_max"][redo])[:, None]
            scaled = _outputs(redo.size)
            _block(x[redo] / s, y[redo] / s, scaled, 0, redo.size)
            for key in ("dd", "xx", "yy", "xy"):
                out[key][redo] = scaled[key]
        dd, xx, yy, xy = out["dd"], out["xx"], out["yy"], out["xy"]
        denom = xx + yy
        rel = np.where(denom > 0, dd / np.where(denom > 0, denom, 1.0), np.where(dd > 0, np.inf, 0.0))
        norm = np.sqrt(xx * yy)
        cosine = np.where(norm > 0, xy / np.where(norm > 0, norm, 1.0), np.nan)
    bitwise = out["bitwise"]
    return RowMetrics(max_abs=np.where(bitwise, 0.0, out["max_abs"]), rel=np.where(finite, rel, np.nan),
                      cosine=np.where(finite, cosine, np.nan), scale=out["scale"], bitwise=bitwise,
                      ref_finite=ref_finite, cand_finite=cand_finite)

"""How a cache stored rows otherwise: the reference's rows rounded to a narrower float, quantized to
a few integer levels with a scale per group, or laid out in another element order give the
candidate's.

Each test is a proof on the rows themselves: a float format where (nearly) every element equals the
reference's rounded to it; an integer format where every candidate element lies on the grid of one
scale per group (absmax over qmax levels, or min/max over 2^bits - 1 levels) and within half a step
of the reference's value; a layout where every row holds exactly the reference's elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# formats a cache may store K/V in, with their mantissa bits (one step: 2^(exponent - bits))
ROUNDINGS = (("bfloat16", 7), ("float16", 10), ("float8_e4m3fn", 3), ("float8_e5m2", 2))
INTEGER_BITS = (8, 4)
ON_GRID = 1e-3          # how far from an integer a value over its group's step may lie (float32 dequantization)


@dataclass(frozen=True)
class Quantization:
    """Integer quantization that gives the candidate's rows: `bits`, `scheme` ("symmetric": absmax
    over 2^(bits-1) - 1 levels a side; "asymmetric": min to max over 2^bits - 1 levels) and `group`
    (what shares one scale: "row and head" or "row")."""

    bits: int
    scheme: str
    group: str

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    def to_json(self) -> dict:
        return {"bits": self.bits, "scheme": self.scheme, "group": self.group}


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to `dtype` (round to nearest even) and back."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float32)
    if dtype.startswith("float8"):      # through torch (numpy has no float8)
        return torch.from_numpy(x).to(getattr(torch, dtype)).to(torch.float32).numpy()
    bits = x.view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def rounding(ref: np.ndarray, cand: np.ndarray) -> tuple[str | None, float]:
    """The dtype whose rounding of the reference's rows gives the candidate's: at least 99% of the
    elements exactly and every other within one step of that dtype (the traces may differ by
    float32 noise before the rounding, which moves a value across a rounding boundary), with the
    share of elements equal."""
    for dtype, mantissa in ROUNDINGS:
        rounded = round_to(ref, dtype)
        with np.errstate(invalid="ignore", divide="ignore"):
            equal = float((rounded == cand).mean()) if cand.size else 0.0
            step = np.exp2(np.floor(np.log2(np.maximum(np.abs(rounded), 1e-30))) - mantissa)
            within = bool((np.abs(cand - rounded) <= step).all())
        if equal >= 0.99 and within and (rounded != ref).any():
            return dtype, equal
    return None, 0.0


def quantization(ref: np.ndarray, cand: np.ndarray) -> Quantization | None:
    """The integer quantization whose grid holds every candidate element, each within half a step
    (plus float32 noise) of the reference's: rows (n, heads, head_dim) are tried with a scale per
    row and head, then per row; None where no format, scheme and grouping does, or where the rows
    are equal."""
    if cand.size == 0 or not np.isfinite(cand).all() or np.array_equal(ref, cand):
        return None
    n = cand.shape[0]
    groups = [("row", (n, -1))] if cand.ndim < 3 else [("row and head", (n * cand.shape[1], -1)), ("row", (n, -1))]
    for bits in INTEGER_BITS:
        for group, shape in groups:
            c, r = cand.reshape(shape).astype(np.float64), ref.reshape(shape).astype(np.float64)
            if c.shape[1] < 8:          # too few elements a group for a grid to prove anything
                continue
            for scheme in ("symmetric", "asymmetric"):
                if _on_grid(r, c, bits, scheme):
                    return Quantization(bits, scheme, group)
    return None


def _on_grid(ref: np.ndarray, cand: np.ndarray, bits: int, scheme: str) -> bool:
    """Every group (row of `cand`) on its scale's grid and within half a step of `ref`, the scale
    taken from the candidate's own extremes (what absmax or min/max quantization maps exactly)."""
    if scheme == "symmetric":
        step = np.abs(cand).max(1) / (2 ** (bits - 1) - 1)
        origin = np.zeros_like(step)
    else:
        origin = cand.min(1)
        step = (cand.max(1) - origin) / (2 ** bits - 1)
    live = step > 0
    if not live.any() or (cand[~live] != ref[~live]).any():
        return False
    c, r, s, o = cand[live], ref[live], step[live, None], origin[live, None]
    q = (c - o) / s
    noise = 1e-5 * np.abs(r).max(1, keepdims=True)
    return bool((np.abs(q - np.round(q)) <= ON_GRID).all() and (np.abs(c - r) <= 0.5 * s * (1 + ON_GRID) + noise).all())


def permuted(ref: np.ndarray, cand: np.ndarray) -> bool:
    """Every candidate row holds exactly the reference row's elements, in another order somewhere
    (a reshape or stride that moves elements across heads or dimensions)."""
    r, c = ref.reshape(ref.shape[0], -1), cand.reshape(cand.shape[0], -1)
    return bool(r.size and not np.array_equal(r, c) and np.array_equal(np.sort(r, 1), np.sort(c, 1)))


def head_scales(ref: np.ndarray, cand: np.ndarray) -> list[float] | None:
    """Per head, the one factor that makes the reference's rows (n, heads, dim) the candidate's at
    every row, within float32 noise, where some head's is not 1 (a head's rows scaled when stored or
    read); None where no factor per head does."""
    if ref.ndim != 3 or ref.shape != cand.shape or not np.isfinite(cand).all():
        return None
    r, c = ref.astype(np.float64), cand.astype(np.float64)
    power = (r * r).sum((0, 2))
    if (power == 0).any():
        return None
    factors = (c * r).sum((0, 2)) / power
    noise = 1e-5 * np.abs(r).max((0, 2)) * np.maximum(np.abs(factors), 1.0)
    if not (np.abs(c - factors[None, :, None] * r) <= noise[None, :, None]).all():
        return None
    if np.allclose(factors, 1.0, rtol=0, atol=1e-5):
        return None
    return [float(f) for f in factors]


def fmt_factors(factors: list[float]) -> str:
    return ", ".join(f"head {h}: x{f:.4g}" for h, f in enumerate(factors))


def scaled_heads_text(point: str, factors: list[float]) -> str:
    """The evidence of `head_scales`: which heads' rows are scaled, by what."""
    scaled = [f"head {h} x{f:.4g}" for h, f in enumerate(factors) if abs(f - 1.0) > 1e-5]
    return (f"the candidate's {point} rows are the reference's with {', '.join(scaled)} (every other head exact): "
            f"those heads' rows were scaled where the cache stored or read them")

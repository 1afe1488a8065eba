"""How a cache stored rows otherwise: the reference's rows rounded to a narrower float, quantized to
a few integer levels with a scale per group, or laid out in another element order give the
candidate's.

Each test is a proof on the rows themselves: a float format where (nearly) every element equals the
reference's rounded to it; an integer format where every candidate element lies on the grid of one
scale per group (absmax over qmax levels, or min/max over 2^bits - 1 levels) and within half a step
of the reference's value; float8 with a scale per group where (nearly) every element equals the
reference's over the group's scale rounded to it; a layout where every row holds exactly the
reference's elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# formats a cache may store K/V in, with their mantissa bits (one step: 2^(exponent - bits))
ROUNDINGS = (("bfloat16", 7), ("float16", 10), ("float8_e4m3fn", 3), ("float8_e5m2", 2))
INTEGER_BITS = (8, 4)
SCALED_FLOATS = (("float8_e4m3fn", 448.0), ("float8_e5m2", 57344.0))    # with their largest finite value
ROW_BLOCKS = (16, 32, 64, 128)      # rows sharing a scale where a cache scales a block of it
EXACT = 1e-6            # a relative distance this small: the same row
ON_GRID = 1e-3          # how far from an integer a value over its group's step may lie (float32 dequantization)


@dataclass(frozen=True)
class Quantization:
    """A scaled format that gives the candidate's rows: `format` ("int8", "int4", "float8_e4m3fn",
    "float8_e5m2"), `scheme` ("symmetric": absmax over 2^(bits-1) - 1 integer levels a side;
    "asymmetric": min to max over 2^bits - 1 levels; "scaled": float8 of the values over absmax / the
    format's largest) and `group` (what shares one scale: "row and head", "row", "N rows" from the first
    row, or "all rows")."""

    format: str
    bits: int
    scheme: str
    group: str

    @property
    def name(self) -> str:
        return self.format

    def to_json(self) -> dict:
        return {"format": self.format, "bits": self.bits, "scheme": self.scheme, "group": self.group}

    def evidence(self) -> str:
        """What the rows are, in words."""
        how = "as integers" if self.format.startswith("int") else "in float8 over that scale"
        return f"the reference's quantized to {self.format} ({self.scheme}, one scale per {self.group}: stored {how})"

    def proof(self) -> str:
        if self.format.startswith("int"):
            return (f"every element lies on its {self.group}'s {self.format} grid ({self.scheme} scale from the group's "
                    f"extremes) and within half a step of the reference's")
        return (f"99% of the elements equal the reference's over its {self.group}'s scale (absmax / the format's "
                f"largest) rounded to {self.format} and scaled back")


def same_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row: `a` and `b` hold the same values (relative distance within EXACT; NaN never does)."""
    x = a.reshape(a.shape[0], -1).astype(np.float64)
    y = b.reshape(b.shape[0], -1).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        rel = np.sqrt(((x - y) ** 2).sum(1) / np.maximum((y * y).sum(1), 1e-300))
    return rel <= EXACT


# unit roundoff of the narrower floats a kernel may compute in, the smallest first
UNIT_ROUNDOFF = (("float16", 2.0 ** -11), ("bfloat16", 2.0 ** -8))


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
    """The scaled format that gives the candidate's rows from the reference's: integers whose grid holds
    every candidate element, each within half a step (plus float32 noise) of the reference's, or float8
    of the reference's over a scale at 99% of the elements exactly; rows (n, heads, head_dim) are tried
    with a scale per row and head, per row, per block of rows and for all of them. None where no
    format, scheme and grouping does, or where the rows are equal."""
    if cand.size == 0 or not np.isfinite(cand).all() or np.array_equal(ref, cand):
        return None
    groups = _groups(cand.shape)
    for bits in INTEGER_BITS:
        for group, shapes in groups:
            pairs = [(r.astype(np.float64), c.astype(np.float64)) for r, c in _split(ref, cand, shapes)]
            if min(c.shape[1] for _, c in pairs) < 8:      # too few elements a group for a grid to prove anything
                continue
            for scheme in ("symmetric", "asymmetric"):
                if all(_on_grid(r, c, bits, scheme) for r, c in pairs):
                    return Quantization(f"int{bits}", bits, scheme, group)
    for dtype, largest in SCALED_FLOATS:
        for group, shapes in groups:
            if all(_scaled_float(r, c, dtype, largest) for r, c in _split(ref, cand, shapes)):
                return Quantization(dtype, 8, "scaled", group)
    return None


def _groups(shape: tuple) -> list[tuple[str, list[tuple[int, int]]]]:
    """Ways to share a scale over rows of `shape`: per row and head (rows (n, heads, dim)), per row,
    per block of rows from the first (the last block may be shorter), all rows; each as the 2D shapes
    (groups, elements) of consecutive row spans, in order."""
    n, per_row = shape[0], int(np.prod(shape[1:]))
    out = [] if len(shape) < 3 else [("row and head", [(n * shape[1], per_row // shape[1])])]
    out.append(("row", [(n, per_row)]))
    for block in ROW_BLOCKS:
        if block < n:
            full = n // block * block
            out.append((f"{block} rows", [(full // block, block * per_row)] + ([(1, (n - full) * per_row)] if n > full else [])))
    return out + [("all rows", [(1, n * per_row)])]


def _split(ref: np.ndarray, cand: np.ndarray, shapes: list[tuple[int, int]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """`ref` and `cand` flattened and cut into the consecutive (groups, elements) spans of `shapes`."""
    r, c, out, at = ref.reshape(-1), cand.reshape(-1), [], 0
    for groups, elements in shapes:
        size = groups * elements
        out.append((r[at:at + size].reshape(groups, elements), c[at:at + size].reshape(groups, elements)))
        at += size
    return out


def _scaled_float(ref: np.ndarray, cand: np.ndarray, dtype: str, largest: float) -> bool:
    """99% of `cand` (groups, elements) equal to `ref` over each group's scale (its absmax over the
    format's largest value), rounded to `dtype` and scaled back, where some element moved."""
    scale = np.abs(cand.astype(np.float64)).max(1, keepdims=True) / largest
    live = scale[:, 0] > 0
    if not live.any() or (cand[~live] != ref[~live]).any():
        return False
    r, c, sc = ref[live].astype(np.float64), cand[live].astype(np.float64), scale[live]
    predicted = round_to((r / sc).astype(np.float32), dtype).astype(np.float64) * sc
    equal = np.isclose(predicted, c, rtol=1e-5, atol=0)
    return bool(equal.mean() >= 0.99 and (predicted != r).any())


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


@dataclass(frozen=True)
class Storage:
    """How rows were stored otherwise: the report fields (`rounding` with `quantization`,
    `layout_permuted` or `head_scale`), the evidence in words and the proof."""

    details: dict
    evidence: str
    proof: str


def stored_as(ref: np.ndarray, cand: np.ndarray, point: str, uniform_scale: bool = True,
              others: dict[str, np.ndarray] | None = None) -> Storage | None:
    """The first of: the reference's rows of another point at the same positions (`others`, such as v
    for k), a narrower float, a scaled format, another element order, one factor per head
    (`uniform_scale` False: not where every head's factor is the same), that gives the candidate's
    `point` rows from the reference's; None where none does."""
    for name, rows in (others or {}).items():
        if rows.shape == cand.shape and same_rows(rows, cand).all():
            return Storage({"copied_from": name},
                           f"the candidate's {point} rows are the reference's {name} rows at the same positions, "
                           f"exactly: {name} was written where {point} belongs",
                           f"every {point} row equals the reference's {name} row exactly")
    dtype, share = rounding(ref, cand)
    if dtype is not None:
        return Storage({"rounding": dtype},
                       f"the candidate's {point} rows are the reference's rounded to {dtype} ({100 * share:.1f}% of the "
                       f"elements exactly, the rest within one {dtype} step): the cache stored them in {dtype}",
                       f"equal to the reference's rows rounded to {dtype} at {100 * share:.1f}% of the elements")
    quant = quantization(ref, cand)
    if quant is not None:
        return Storage({"rounding": quant.name, "quantization": quant.to_json()},
                       f"the candidate's {point} rows are {quant.evidence()}", quant.proof())
    if permuted(ref, cand):
        return Storage({"layout_permuted": True},
                       f"every {point} row holds exactly the reference's elements in another order: the cache's "
                       f"layout differs (a reshape or stride that moves elements across heads or dimensions)",
                       f"every {point} row's elements are the reference row's, reordered")
    scales = head_scales(ref, cand)
    if scales is None or (not uniform_scale and np.allclose(scales, scales[0])):
        return None
    scaled = ", ".join(f"head {h} x{f:.4g}" for h, f in enumerate(scales) if abs(f - 1.0) > 1e-5)
    return Storage({"head_scale": {"point": point, "factors": scales}},
                   f"the candidate's {point} rows are the reference's with {scaled} (every other head exact): those "
                   f"heads' rows were scaled where the cache stored or read them",
                   f"every {point} row is the reference's times one factor per head "
                   f"({', '.join(f'head {h}: x{f:.4g}' for h, f in enumerate(scales))})")

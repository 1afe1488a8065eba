"""Tolerances per probe point and the three tiers a compared row falls into.

Defaults come from torch.testing's per-dtype (atol, rtol), applied to the row's scale rather than
element by element: a row is noise when ``max_abs <= atol + rtol * max(|ref row|)``. Hidden states
grow large and their rounding errors come from reductions over the whole row (dot products, sums
of squares), so an element near zero in a row of norm 100 carries an error of ~eps*100; a
per-element ``allclose`` flags that as divergent although it is the same computation rounded
differently. Scaling by the row's largest magnitude keeps the tolerance meaningful at every depth.

torch.testing's float32 rtol (1.3e-6, ~11 ulps) is meant for one operation. Measured on
SmolLM2-135M in float32 (one-token decode vs batched prefill of the same 32 tokens), reordered
reductions reach 4.5e-6 of the row scale after 30 layers on an AVX-512 CPU, and the element-wise
check fails 31 of 32 rows. On an AVX2 CPU (AMD EPYC, MKL), `prefix` in fast numerics on the
seeds' conversation reaches 2.6e-5 (the BOS row's MLP output at layer 10), so the float32
default rtol is 1e-4: about 4x the largest reordering noise measured, while a real divergence
(another position, missing context) moves rows by a good part of their scale. bfloat16 and
float16 keep torch.testing's values: their rounding step (2^-8, 2^-11) dwarfs
accumulation-order effects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from typing import Mapping

from kvdiff.errors import InputError
from kvdiff.trace.points import KNOWN_POINTS


class Tier(IntEnum):
    """How far apart two rows are; stored as small ints in the maps (-1: not compared)."""

    BITWISE = 0
    NOISE = 1
    DIVERGENT = 2
    INCOMPARABLE = 3
    DIFFERENT = 4       # digest traces, outside the zoom window: the bits differ, by how much is not known

    @property
    def label(self) -> str:
        return self.name.lower()


NOT_COMPARED = -1


@dataclass(frozen=True)
class Tolerance:
    """A row is within tolerance when max_abs <= atol + rtol * (largest |reference| in the row)."""

    atol: float
    rtol: float

    def bound(self, scale):
        """The largest allowed max-abs difference for rows whose reference scale is `scale`."""
        return self.atol + self.rtol * scale


# torch.testing.assert_close defaults per dtype (float32's rtol widened, see above).
DTYPE_DEFAULTS: dict[str, Tolerance] = {
    "float32": Tolerance(atol=1e-5, rtol=1e-4),
    "bfloat16": Tolerance(atol=1e-5, rtol=1.6e-2),
    "float16": Tolerance(atol=1e-5, rtol=1e-3),
}

# Points holding ids, not measurements: any difference is another choice (an expert id of 100 next to
# 101 would pass a bfloat16 rtol).
EXACT_POINTS: dict[str, Tolerance] = {"experts": Tolerance(atol=0.0, rtol=0.0)}


@dataclass(frozen=True)
class Tolerances:
    """The tolerance for each probe point: a dtype default (exact for `EXACT_POINTS`) and per-point overrides."""

    default: Tolerance
    per_point: Mapping[str, Tolerance]

    def for_point(self, point: str) -> Tolerance:
        return self.per_point.get(point, EXACT_POINTS.get(point, self.default))

    @classmethod
    def for_dtypes(cls, *dtypes: str, overrides: Mapping[str, Tolerance] | None = None) -> "Tolerances":
        """Defaults of the loosest of the traces' dtypes, with `overrides` per point."""
        known = [DTYPE_DEFAULTS[d] for d in dtypes if d in DTYPE_DEFAULTS] or [DTYPE_DEFAULTS["float32"]]
        default = max(known, key=lambda t: (t.rtol, t.atol))
        for point in overrides or {}:
            if point not in KNOWN_POINTS:
                raise InputError(f"unknown probe point {point!r} in tolerances; use one of {', '.join(KNOWN_POINTS)}")
        return cls(default=default, per_point=dict(overrides or {}))


def parse_tolerance(spec: str) -> tuple[str, Tolerance]:
    """Parse ``POINT=ATOL[,RTOL]`` (RTOL defaults to 0) as given on the command line."""
    point, sep, values = spec.partition("=")
    parts = values.split(",")
    try:
        if not sep or not point or len(parts) > 2:
            raise ValueError
        atol = float(parts[0])
        rtol = float(parts[1]) if len(parts) == 2 else 0.0
        if not (0 <= atol < math.inf and 0 <= rtol < math.inf):     # NaN fails every comparison
            raise ValueError
    except ValueError:
        raise InputError(f"bad tolerance {spec!r}; write POINT=ATOL[,RTOL] with finite numbers >= 0, "
                         "e.g. logits=1e-4,1e-3") from None
    if point not in KNOWN_POINTS:
        raise InputError(f"unknown probe point {point!r} in tolerance {spec!r}; use one of {', '.join(KNOWN_POINTS)}")
    return point, Tolerance(atol, rtol)

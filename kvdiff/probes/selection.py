"""What a recorder keeps: which probe points, which layers, which positions (default: all)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, NoReturn

import numpy as np

from kvdiff.errors import InputError
from kvdiff.probes.points import ALL_POINTS, FINAL_POINTS, POINT_ORDER


def parse_ranges(spec: str, what: str, limit: int | None = None) -> list[int]:
    """'0-3,29' -> [0, 1, 2, 3, 29]; with `limit`, every number must be below it (checked before
    a range is expanded, so '0-99999999999' fails at once)."""
    out: list[int] = []
    for lo, hi in check_ranges(spec, what, limit):
        out.extend(range(lo, hi + 1))
    return out


def check_ranges(spec: str, what: str, limit: int | None = None) -> list[tuple[int, int]]:
    """The (first, last) pairs of '0-3,29', checked but not expanded: the syntax can be checked
    before the model (and so the limit) is known."""
    pairs: list[tuple[int, int]] = []
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        first, sep, last = part.partition("-")
        try:
            lo, hi = int(first), int(last) if sep else int(first)
        except ValueError:
            raise InputError(f"bad {what} {part!r} in {spec!r}: use numbers and ranges like 0-3,29") from None
        if lo < 0 or hi < lo:
            raise InputError(f"bad {what} range {part!r}: give first-last with 0 <= first <= last")
        if limit is not None and hi >= limit:
            _out_of_range(what, part, limit)
        pairs.append((lo, hi))
    return pairs


def _out_of_range(what: str, given: str, limit: int) -> NoReturn:
    raise InputError(f"{what}(s) {given} out of range: the model has {what}s 0-{limit - 1}")


def format_ranges(positions: Iterable[int]) -> str:
    """[3, 4, 5, 6, 7, 9] -> '3-7,9' (the inverse of parse_ranges)."""
    pos = np.unique(np.fromiter(positions, dtype=np.int64))
    if pos.size == 0:
        return ""
    breaks = np.flatnonzero(np.diff(pos) != 1)
    starts = np.concatenate(([pos[0]], pos[breaks + 1]))
    ends = np.concatenate((pos[breaks], [pos[-1]]))
    return ",".join(str(s) if s == e else f"{s}-{e}" for s, e in zip(starts, ends))


def parse_points(capture: str | Iterable[str]) -> tuple[str, ...]:
    """'q, k' (or ['q', 'k']) -> ('q', 'k') in dataflow order; unknown names are an InputError."""
    names = [p.strip() for p in capture.split(",")] if isinstance(capture, str) else list(capture)
    unknown = [p for p in names if p not in POINT_ORDER]
    if unknown or not names:
        raise InputError(f"unknown probe point(s) {', '.join(unknown) or '(none)'}: "
                         f"choose from {', '.join(ALL_POINTS)}")
    return tuple(sorted(set(names), key=POINT_ORDER.__getitem__))


def _as_ints(value: str | int | Iterable[int], what: str, limit: int | None = None) -> list[int]:
    if isinstance(value, str):
        return parse_ranges(value, what, limit)
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


@dataclass(frozen=True)
class Selection:
    """The probe points, layers and (optionally) positions a recorder writes."""

    points: tuple[str, ...]
    layers: tuple[int, ...]
    positions: frozenset[int] | None = None    # None: every position

    @classmethod
    def parse(cls, num_layers: int, capture: str | Iterable[str] | None = None,
              layers: str | int | Iterable[int] | None = None,
              positions: str | int | Iterable[int] | None = None) -> "Selection":
        """Build from CLI-style strings ('k,v', '0-3,29') or Python values; None means everything."""
        points = ALL_POINTS if capture is None else parse_points(capture)
        chosen = list(range(num_layers)) if layers is None else sorted(set(_as_ints(layers, "layer", num_layers)))
        bad = [i for i in chosen if not 0 <= i < num_layers]
        if bad:
            _out_of_range("layer", format_ranges(bad), num_layers)
        pos = None if positions is None else frozenset(_as_ints(positions, "position"))
        return cls(points, tuple(chosen), pos)

    def wants(self, point: str, layer: int | None) -> bool:
        if point not in self.points:
            return False
        return layer is None if point in FINAL_POINTS else layer in self.layers

    def declared(self) -> list[tuple[str, int | None]]:
        """Every (point, layer) that must fire once in each forward."""
        out: list[tuple[str, int | None]] = []
        for layer in self.layers:
            out.extend((p, layer) for p in self.points if p not in FINAL_POINTS)
        out.extend((p, None) for p in self.points if p in FINAL_POINTS)
        return out

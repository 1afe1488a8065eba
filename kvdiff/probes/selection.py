"""What a recorder keeps: which probe points, which layers, which positions (default: all)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from kvdiff.trace.points import ALL_POINTS, FINAL_POINTS, parse_points
from kvdiff.trace.ranges import format_ranges, out_of_range, parse_ranges


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
            out_of_range("layer", format_ranges(bad), num_layers)
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

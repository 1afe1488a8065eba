"""What a recorder keeps: which probe points, which layers, which positions (default: all)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from kvdiff.errors import InputError
from kvdiff.trace.points import ALL_POINTS, FINAL_POINTS, READ_POINTS, parse_points
from kvdiff.trace.ranges import format_ranges, out_of_range, parse_ranges


def _as_ints(value: str | int | Iterable[int], what: str, limit: int | None = None) -> list[int]:
    if isinstance(value, str):
        return parse_ranges(value, what, limit)
    values = [value] if isinstance(value, int) else [int(v) for v in value]
    negative = [v for v in values if v < 0]
    if negative:
        raise InputError(f"bad {what} {negative[0]}: {what}s count from 0")
    return values


@dataclass(frozen=True)
class Selection:
    """The probe points, layers and (optionally) positions a recorder writes."""

    points: tuple[str, ...]
    layers: tuple[int, ...]
    positions: frozenset[int] | None = None    # None: every position
    # a zoom window's keys: positions (before its own) where k and v of its layers are kept too
    keys: frozenset[int] = frozenset()

    @classmethod
    def parse(cls, num_layers: int, capture: str | Iterable[str] | None = None,
              layers: str | int | Iterable[int] | None = None,
              positions: str | int | Iterable[int] | None = None,
              available: tuple[str, ...] = ALL_POINTS) -> "Selection":
        """Build from CLI-style strings ('k,v', '0-3,29') or Python values; None means everything.
        `available`: the points the model has (`ModelDims.points()`; the router's only with experts)."""
        points = available if capture is None else parse_points(capture)
        missing = [p for p in points if p not in available]
        if missing:
            raise InputError(f"probe point(s) {', '.join(missing)} are not this model's (the router's need a "
                             f"mixture-of-experts model, kv_latent multi-head latent attention, which has no v or z, "
                             f"attn_sinks attention sinks, the post-norms Gemma 3's): it has {', '.join(available)}")
        chosen = list(range(num_layers)) if layers is None else sorted(set(_as_ints(layers, "layer", num_layers)))
        bad = [i for i in chosen if not 0 <= i < num_layers]
        if bad:
            out_of_range("layer", format_ranges(bad), num_layers)
        pos = None if positions is None else frozenset(_as_ints(positions, "position"))
        return cls(points, tuple(chosen), pos)

    def window(self, layers: str | int | Iterable[int] | None = None,
               positions: str | int | Iterable[int] | None = None, final: bool | None = None,
               keys: str | int | Iterable[int] | None = None) -> "Selection":
        """The zoom window of a digest trace over this selection: full rows of its points at
        `layers` x `positions` (None: every one of them), and of its final points when `final`
        (None: when the window holds its last layer); nothing when both are None. `keys`: positions
        where the window's layers keep their k and v rows too (the keys attention read at its rows)."""
        if layers is None and positions is None:
            return Selection((), (), frozenset())
        chosen = self.layers if layers is None else Selection.parse(max(self.layers, default=-1) + 1, self.points,
                                                                    layers, None, self.points).layers
        if final is None:
            final = bool(chosen) and bool(self.layers) and chosen[-1] == self.layers[-1]
        points = tuple(p for p in self.points if final or p not in FINAL_POINTS)
        pos = None if positions is None else frozenset(_as_ints(positions, "position"))
        extra = frozenset() if keys is None or pos is None else frozenset(_as_ints(keys, "position")) - pos
        return Selection(points, tuple(i for i in chosen if i in self.layers), pos, extra)

    def keeps_keys(self, point: str) -> bool:
        """Whether `point`'s rows are kept at the window's key positions as well."""
        return bool(self.keys) and point in READ_POINTS and point in self.points

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

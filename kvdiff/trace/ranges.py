"""Layer and position ranges as users write them: '0-3,29' <-> [0, 1, 2, 3, 29]."""

from __future__ import annotations

from typing import Iterable, NoReturn

import numpy as np

from kvdiff.errors import InputError


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
            out_of_range(what, part, limit)
        pairs.append((lo, hi))
    return pairs


def out_of_range(what: str, given: str, limit: int) -> NoReturn:
    """Raise the InputError for `given` numbers past the model's `limit`."""
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

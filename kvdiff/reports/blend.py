"""blend's errors position by position (report.json `blend_errors`) for the terminal report: a
summary of the recomputed and the other placed positions against the isolated strategies."""

from __future__ import annotations

import numbers
import statistics
from dataclasses import dataclass
from typing import Any, Callable

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from kvdiff.reports.printable import printable

STRATEGIES = ("blend", "isolated-local", "isolated-global")


@dataclass(frozen=True)
class BlendErrors:
    """The `blend_errors` section: per placed position, whether blend recomputed it, and each
    strategy's error there (None where the report holds no number)."""

    positions: list[int]
    recomputed: list[bool]
    errors: dict[str, list[float | None]]

    @classmethod
    def of(cls, section: Any) -> "BlendErrors | None":
        """The section read from a report.json; None when absent or not of its documented shape."""
        if not isinstance(section, dict):
            return None
        positions, recomputed = section.get("positions"), section.get("recomputed")
        columns = [section.get(s) for s in STRATEGIES]
        if not (isinstance(positions, list) and isinstance(recomputed, list) and all(isinstance(c, list) for c in columns)
                and all(len(x) == len(positions) for x in (recomputed, *columns))):
            return None
        if not all(isinstance(p, numbers.Integral) and not isinstance(p, bool) for p in positions):
            return None
        number = lambda v: float(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else None  # noqa: E731
        return cls([int(p) for p in positions], [v is True for v in recomputed],
                   {s: [number(v) for v in c] for s, c in zip(STRATEGIES, columns)})

    def rows(self, recomputed: bool) -> list[int]:
        """Indices of the recomputed (or the other) placed positions."""
        return [i for i, r in enumerate(self.recomputed) if r == recomputed]

    def mended(self) -> int:
        """How many recomputed positions blend leaves with at most either isolated strategy's error."""
        def at_most(i: int) -> bool:
            b, others = self.errors["blend"][i], [self.errors[s][i] for s in STRATEGIES[1:]]
            return b is not None and all(o is not None and b <= o for o in others)
        return sum(at_most(i) for i in self.rows(True))


def _fmt(value: float) -> str:
    return "0" if value == 0 else f"{value:.3g}"


def _cell(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{_fmt(statistics.median(known))} / {_fmt(max(known))}" if known else "–"


def blend_errors_text(section: Any, chunk_at: Callable[[int], str] = lambda p: "prompt",
                      plain: bool = False) -> Group | None:
    """The terminal's summary of `blend_errors` (fits 80 columns): a row per chunk and whether
    blend recomputed the positions; None without the section."""
    view = BlendErrors.of(section)
    if view is None or not view.positions:
        return None
    title = Text("blend vs isolated: k's rel to the reference, largest over layers (median / max)",
                 style="" if plain else "bold")
    table = Table(box=box.SIMPLE_HEAD, header_style="" if plain else "bold", padding=(0, 1))
    for name in ("placed positions", *STRATEGIES):
        table.add_column(name, overflow="fold")
    rows: dict[tuple[str, bool], list[int]] = {}
    for i, (p, again) in enumerate(zip(view.positions, view.recomputed)):
        rows.setdefault((chunk_at(p), again), []).append(i)
    for (chunk, again), indices in rows.items():
        label = f"{printable(chunk, keep='')} {'recomputed' if again else 'kept'} ({len(indices)})"
        table.add_row(label, *(_cell([view.errors[s][i] for i in indices]) for s in STRATEGIES))
    verdict = Text(f"blend's error is at most both isolated strategies' at {view.mended()} of "
                   f"{len(view.rows(True))} recomputed positions (each position: report.json "
                   "blend_errors, the HTML report)")
    return Group(title, table, verdict)

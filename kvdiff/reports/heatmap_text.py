"""The terminal heatmap: layers x positions of one probe point, bucketed to the console width.

Positions are grouped by chunk; each chunk gets columns in proportion to its length (at least
one), a bucket never straddles two chunks, and a `│` column marks every chunk boundary. A cell
shows the worst tier of its bucket as a glyph (readable without colour) coloured by the
bucket's largest `rel` on a log scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from rich.text import Text

from kvdiff.analysis.report import TIERS, Report
from kvdiff.reports.printable import printable

GLYPHS: dict[str | None, str] = {
    "bitwise": "·", "noise": "░", "different": "▒", "divergent": "█", "incomparable": "/", None: " ",
}
_RANK: dict[str | None, int] = {None: 0, "incomparable": 1, "bitwise": 2, "noise": 3, "different": 4, "divergent": 5}
LOG_MIN, LOG_MAX = -8.0, 0.0  # rel colour ramp spans 1e-8 .. 1
_STOPS = ((0.0, (49, 54, 149)), (0.35, (116, 173, 209)), (0.55, (254, 224, 144)),
          (0.75, (244, 109, 67)), (1.0, (165, 0, 38)))
_BITWISE_COLOUR = "#767676"
_FINAL_LABELS = {"final_norm": "norm", "logits": "logit"}


def ramp_colour(rel: float) -> str:
    """Hex colour of `rel` on the log ramp (grey for an exact zero)."""
    if rel <= 0:
        return _BITWISE_COLOUR
    t = (min(max(math.log10(rel), LOG_MIN), LOG_MAX) - LOG_MIN) / (LOG_MAX - LOG_MIN)
    for (t0, c0), (t1, c1) in zip(_STOPS, _STOPS[1:]):
        if t <= t1:
            f = (t - t0) / (t1 - t0)
            return "#" + "".join(f"{round(a + (b - a) * f):02x}" for a, b in zip(c0, c1))
    return "#%02x%02x%02x" % _STOPS[-1][1]


@dataclass(frozen=True)
class Segment:
    """Consecutive heatmap columns (indices into the positions list) of one chunk."""

    name: str
    columns: list[int]


def segments(view: Report, positions: Sequence[int]) -> list[Segment]:
    """Group the heatmap's positions into runs of the same chunk."""
    out: list[Segment] = []
    for index, position in enumerate(positions):
        name = view.chunk_at(position)
        if out and out[-1].name == name:
            out[-1].columns.append(index)
        else:
            out.append(Segment(name, [index]))
    return out


def allocate(lengths: Sequence[int], budget: int) -> list[int]:
    """Columns per segment: all of them if they fit, else proportional (largest remainder, min 1)."""
    if sum(lengths) <= budget:
        return list(lengths)
    spare = max(budget - len(lengths), 0)
    total = sum(lengths)
    shares = [spare * n / total for n in lengths]
    counts = [1 + math.floor(s) for s in shares]
    by_remainder = sorted(range(len(lengths)), key=lambda i: math.floor(shares[i]) - shares[i])
    for i in by_remainder[: budget - sum(counts)]:
        counts[i] += 1
    return [min(c, n) for c, n in zip(counts, lengths)]


def buckets(columns: list[int], count: int) -> list[list[int]]:
    """Split `columns` into `count` contiguous, near-equal buckets."""
    return [columns[len(columns) * i // count: len(columns) * (i + 1) // count] for i in range(count)]


def _cell(rel_row: Sequence[Any], tier_row: Sequence[Any], bucket: list[int]) -> Text:
    tiers = [t if t in TIERS else None for t in (tier_row[i] for i in bucket)]
    tier = max(tiers, key=_RANK.__getitem__)
    rels = [float(rel_row[i]) for i in bucket if isinstance(rel_row[i], (int, float))]
    finite = [r for r in rels if not math.isnan(r)]
    if tier in (None, "incomparable") or not finite:
        return Text(GLYPHS[tier], style="grey50" if tier else "")
    return Text(GLYPHS[tier], style=ramp_colour(max(finite)))


def _rows(view: Report, point: str) -> list[tuple[str, list[Any], list[Any]]]:
    grid = view.heatmaps[point]
    rows = [(f"L{layer}", list(rel), list(tiers)) for layer, rel, tiers
            in zip(grid.get("layers") or [], grid.get("rel") or [], grid.get("tiers") or [])]
    positions = list(grid.get("positions") or [])
    for name, final in view.final.items():
        where = {p: i for i, p in enumerate(final.get("positions") or [])}
        rel, tiers = final.get("rel") or [], final.get("tiers") or []
        picks = [where.get(p) for p in positions]
        rows.append((_FINAL_LABELS.get(name, name[:5]),
                     [rel[i] if i is not None and i < len(rel) else None for i in picks],
                     [tiers[i] if i is not None and i < len(tiers) else None for i in picks]))
    return rows


def _fit_number(number: int, count: int) -> str:
    """`number` in `count` columns: whole, or cut with "…" so that a cut start position (1523 as
    "15") is never read as another number. Names are only cut: "us" is still a prefix of user#2."""
    text = str(number)
    return text.ljust(count) if len(text) <= count else text[:count - 1] + "…"


def _header(segs: list[Segment], counts: list[int], positions: Sequence[int], pad: int) -> Text:
    names, starts = Text(" " * pad), Text(" " * pad)
    for k, (seg, count) in enumerate(zip(segs, counts)):
        sep = "│" if k else ""
        names.append(sep + printable(seg.name, keep="")[:count].ljust(count), style="cyan")
        starts.append(sep + _fit_number(positions[seg.columns[0]], count), style="grey50")
    return Text("\n").join([names, starts])


def heatmap_text(view: Report, point: str, width: int) -> Text:
    """The heatmap of `point` with a chunk header and a legend, fitted to `width` columns."""
    rows = _rows(view, point)
    positions = list(view.heatmaps[point].get("positions") or [])
    if not rows or not positions:
        return Text(f"(no data captured for {point})")
    label_width = max(len(label) for label, _, _ in rows) + 1
    segs = segments(view, positions)
    counts = allocate([len(s.columns) for s in segs], width - label_width - (len(segs) - 1))
    plan = [buckets(seg.columns, count) for seg, count in zip(segs, counts)]
    lines = [_header(segs, counts, positions, label_width)]
    for label, rel, tiers in rows:
        line = Text(label.rjust(label_width - 1) + " ", style="grey50")
        for k, seg_buckets in enumerate(plan):
            if k:
                line.append("│", style="cyan")
            for bucket in seg_buckets:
                line.append_text(_cell(rel, tiers, bucket))
        lines.append(line)
    per_column = max(len(b) for seg_buckets in plan for b in seg_buckets)
    lines.append(legend(per_column, blank=any(t is None for _, _, tiers in rows for t in tiers),
                        different=any(t == "different" for _, _, tiers in rows for t in tiers)))
    return Text("\n").join(lines)


def legend(per_column: int, blank: bool = False, different: bool = False) -> Text:
    """Glyph key, the colour ramp by decade, and how many positions one column holds; `blank`:
    some cells are not recorded (the candidate read those positions' K/V from its cache);
    `different`: some cells of a digest trace differ by an amount known only in its zoom window."""
    text = Text()
    for tier in TIERS:
        if tier != "different":
            text.append(f"{GLYPHS[tier]} {tier}  ")
    if different:
        text.append(f"{GLYPHS['different']} bits differ (outside the zoom window: colour is a lower bound)  ")
    if blank:
        text.append("blank: not recorded (K/V read from the cache)  ")
    text.append("rel_diff ")
    for exponent in range(int(LOG_MIN), int(LOG_MAX) + 1, 2):
        text.append("█", style=ramp_colour(10.0 ** exponent))
        text.append(f"1e{exponent} ")
    if per_column > 1:
        text.append(f" ({per_column} positions/column, worst shown)")
    return text

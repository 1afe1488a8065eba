"""The report: what the analysis hands the renderers (terminal, HTML), typed.

`Divergence.report()` makes one; `Report.from_json` checks a report.json read from elsewhere
(only `schema_version`, `verdict` and `tokens_identical` are required; every other key of the
contract is optional and reads as empty: no heatmaps, no chunks, no firsts). `to_json()` is
the report.json rendering (docs/report-format.md).
"""

from __future__ import annotations

import numbers
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any

from kvdiff.errors import InputError
from kvdiff.analysis.tolerance import Tier
from kvdiff.trace.points import ALL_POINTS, POINT_ORDER

SCHEMA_VERSION = 1
TIERS: tuple[str, ...] = tuple(t.label for t in Tier)
GENERATED = "generated"  # label of positions past the last prompt chunk


@dataclass(frozen=True)
class Chunk:
    """One prompt chunk: global positions [first, last] and where its KV was encoded."""

    name: str
    first: int
    last: int
    hash: str
    cache: str
    encoded: tuple[int, int] | None


@dataclass(frozen=True)
class Report:
    """The report's parts the renderers use, with defaults for absent optional keys; `raw` is
    the whole report.json document."""

    raw: dict[str, Any] = field(repr=False)
    verdict: str
    tokens_identical: bool
    prompt_tokens: list[str]
    reference_tokens: list[str]
    candidate_tokens: list[str]
    chunks: list[Chunk]
    heatmaps: dict[str, dict[str, Any]]
    final: dict[str, dict[str, Any]]
    diagnoses: list[dict[str, Any]] = field(default_factory=list)
    # first position of each chunk (in order, without overlaps): chunk_at bisects it
    chunk_firsts: list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunk_firsts", [c.first for c in self.chunks])

    @classmethod
    def from_json(cls, document: Any) -> "Report":
        """A report.json document (schema_version 1), checked; InputError with one line otherwise."""
        return load_report(document)

    def to_json(self) -> dict[str, Any]:
        """The report.json document."""
        return self.raw

    @property
    def top_diagnosis(self) -> dict[str, Any] | None:
        """The diagnosis the report leads with (`top_diagnosis`, an index into `diagnoses`)."""
        index = self.raw.get("top_diagnosis")
        valid = isinstance(index, int) and not isinstance(index, bool) and 0 <= index < len(self.raw.get("diagnoses") or [])
        return self.raw["diagnoses"][index] if valid and isinstance(self.raw["diagnoses"][index], dict) else None

    def section(self, key: str) -> dict[str, Any]:
        """A dict-valued top-level key ({} when absent or null)."""
        value = self.raw.get(key)
        return value if isinstance(value, dict) else {}

    def first(self, key: str) -> dict[str, Any] | None:
        """`first_token_divergence`, `first_bit_difference`, `first_divergence` or `first_large_divergence`,
        or None."""
        value = self.raw.get(key)
        return value if isinstance(value, dict) else None

    @property
    def first_input_difference(self) -> int | None:
        """The first position whose input ids differ (the traces are of different prompts), or None."""
        value = self.raw.get("first_input_difference")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def recorded_with_different(self) -> list[str]:
        """What the two runs had different that no probe shows ("weights", "tokenizers")."""
        value = self.raw.get("recorded_with_different")
        return [str(v) for v in value] if isinstance(value, list) else []

    def chunk_at(self, position: int) -> str:
        """Name of the chunk holding `position` ("generated" past the prompt; "prompt" in a
        report of traces without chunks, "?" in a prompt position no chunk holds)."""
        i = bisect_right(self.chunk_firsts, position) - 1
        if i >= 0 and position <= self.chunks[i].last:
            return self.chunks[i].name
        return GENERATED if position >= len(self.prompt_tokens) else "?" if self.chunks else "prompt"

    def token_at(self, position: int) -> str:
        """Text of the reference sequence's token at `position` ("" when unknown)."""
        if position < len(self.prompt_tokens):
            return self.prompt_tokens[position]
        step = position - len(self.prompt_tokens)
        return self.reference_tokens[step] if 0 <= step < len(self.reference_tokens) else ""

    def points(self) -> list[str]:
        """Probe points with a heatmap, in dataflow order (unknown names last)."""
        return sorted(self.heatmaps, key=lambda p: (POINT_ORDER.get(p, len(ALL_POINTS)), p))

    def default_point(self) -> str | None:
        """The point that tells the cause apart: `k` when RoPE breaks (k_pre_rope equal, k not),
        else the first breaking operation's output, the first tolerance breach, `k`, the earliest."""
        points = self.points()
        breach = self.first("first_divergence")
        operation = self.first("first_operation") or {}
        rope = str(operation.get("operation", "")).startswith("RoPE") and "k"
        for candidate in (rope, operation.get("tensor"), (breach or {}).get("tensor"), "k"):
            if candidate in self.heatmaps:
                return candidate
        return points[0] if points else None


def _tokens(section: Any) -> list[str]:
    tokens = section.get("tokens") if isinstance(section, dict) else None
    return [str(t) for t in tokens] if isinstance(tokens, list) else []


def _bad(what: str, value: Any) -> InputError:
    shown = repr(value) if isinstance(value, (str, int, float, bool)) or value is None else type(value).__name__
    return InputError(f"report {what}, not {shown[:60]}: is it a kvdiff report.json?")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)      # numpy's ints too


def _span(value: Any, what: str) -> tuple[int, int] | None:
    """[first, last] of non-negative ints, or None when absent."""
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 2 and all(map(_is_int, value)) and 0 <= value[0] <= value[1]):
        raise _bad(f"{what} must be [first, last] with 0 <= first <= last", value)
    return int(value[0]), int(value[1])


def _chunks(entries: Any) -> list[Chunk]:
    """The chunk table: objects whose spans are in order and do not overlap (as a trace's are)."""
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise _bad("'chunks' must be a list", entries)
    out: list[Chunk] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise _bad(f"chunk {i} must be an object", entry)
        first, last = _span(entry.get("positions"), f"chunk {i} positions") or (0, -1)
        if out and first <= out[-1].last:
            raise _bad(f"chunk {i} must start after chunk {i - 1} ends ({out[-1].last})", first)
        out.append(Chunk(name=str(entry.get("name", "?")), first=first, last=last, hash=str(entry.get("hash") or ""),
                         cache=str(entry.get("cache") or "?"),
                         encoded=_span(entry.get("encoded_positions"), f"chunk {i} encoded_positions")))
    return out


def _grids(value: Any, key: str, final: bool) -> dict[str, dict[str, Any]]:
    """`heatmaps` or `final`: probe point -> {positions, rel, tiers[, layers]}, rows as long as positions."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad(f"{key!r} must be an object", value)
    for point, grid in value.items():
        where = f"{key} {point!r}"
        if not isinstance(grid, dict):
            raise _bad(f"{where} must be an object", grid)
        positions = grid.get("positions") or []
        if not (isinstance(positions, list) and all(map(_is_int, positions))):
            raise _bad(f"{where} positions must be a list of integers", positions)
        rows = [grid.get("rel") or [], grid.get("tiers") or []] if final else \
            [row for name in ("rel", "tiers") for row in (grid.get(name) or [])]
        if not isinstance(grid.get("layers") or [], list) or \
                not all(isinstance(row, list) and len(row) == len(positions) for row in rows):
            raise _bad(f"{where} rows must be lists as long as its positions", rows[0] if rows else None)
    return value


def load_report(report: Any) -> Report:
    """Check `report` (schema_version 1) and wrap it; InputError with one line otherwise. Parts
    the renderers read are checked for their types, so a report.json from elsewhere renders or
    is refused, never crashes a renderer."""
    if not isinstance(report, dict):
        raise InputError(f"report must be a JSON object, got {type(report).__name__}")
    version = report.get("schema_version")
    if version != SCHEMA_VERSION:
        raise InputError(
            f"report schema_version {version!r} is not supported (expected {SCHEMA_VERSION}); "
            "re-create it with this kvdiff version"
        )
    for key in ("verdict", "tokens_identical"):
        if key not in report:
            raise InputError(f"report has no {key!r}: is it a kvdiff report.json?")
    verdict, identical = report["verdict"], report["tokens_identical"]
    if not isinstance(identical, bool):
        raise _bad("'tokens_identical' must be true or false", identical)
    if verdict != ("identical" if identical else "divergent"):
        raise _bad(f"'verdict' must be {'identical' if identical else 'divergent'!r} "
                   f"(tokens_identical is {str(identical).lower()})", verdict)
    diagnoses = report.get("diagnoses")
    return Report(
        raw=report,
        verdict=verdict,
        tokens_identical=identical,
        prompt_tokens=_tokens(report.get("prompt")),
        reference_tokens=_tokens(report.get("reference")),
        candidate_tokens=_tokens(report.get("candidate")),
        chunks=_chunks(report.get("chunks")),
        heatmaps=_grids(report.get("heatmaps"), "heatmaps", final=False),
        final=_grids(report.get("final"), "final", final=True),
        diagnoses=[d for d in diagnoses or [] if isinstance(d, dict)] if isinstance(diagnoses, list) else [],
    )

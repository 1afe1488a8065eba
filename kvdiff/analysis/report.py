"""The report: what the analysis hands the renderers (terminal, HTML), typed.

`Divergence.report()` makes one; `Report.from_json` checks a report.json read from elsewhere
(only `schema_version`, `verdict` and `tokens_identical` are required; every other key of the
contract is optional and reads as empty: no heatmaps, no chunks, no firsts). `to_json()` is
the report.json rendering (docs/report-format.md).
"""

from __future__ import annotations

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
        """`first_token_divergence`, `first_bit_difference` or `first_divergence`, or None."""
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
        for chunk in self.chunks:
            if chunk.first <= position <= chunk.last:
                return chunk.name
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
        """The point that shows the first tolerance breach, else `k`, else the earliest one."""
        points = self.points()
        breach = self.first("first_divergence")
        for candidate in ((breach or {}).get("tensor"), "k"):
            if candidate in self.heatmaps:
                return candidate
        return points[0] if points else None


def _tokens(section: Any) -> list[str]:
    tokens = section.get("tokens") if isinstance(section, dict) else None
    return [str(t) for t in tokens] if isinstance(tokens, list) else []


def _span(value: Any) -> tuple[int, int] | None:
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return int(value[0]), int(value[1])
    return None


def _chunk(entry: dict[str, Any]) -> Chunk:
    first, last = _span(entry.get("positions")) or (0, -1)
    return Chunk(
        name=str(entry.get("name", "?")),
        first=first,
        last=last,
        hash=str(entry.get("hash") or ""),
        cache=str(entry.get("cache") or "?"),
        encoded=_span(entry.get("encoded_positions")),
    )


def load_report(report: Any) -> Report:
    """Check `report` (schema_version 1) and wrap it; InputError with one line otherwise."""
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
    heatmaps = report.get("heatmaps")
    final = report.get("final")
    diagnoses = report.get("diagnoses")
    return Report(
        raw=report,
        verdict=str(report["verdict"]),
        tokens_identical=bool(report["tokens_identical"]),
        prompt_tokens=_tokens(report.get("prompt")),
        reference_tokens=_tokens(report.get("reference")),
        candidate_tokens=_tokens(report.get("candidate")),
        chunks=[_chunk(c) for c in report.get("chunks") or [] if isinstance(c, dict)],
        heatmaps=heatmaps if isinstance(heatmaps, dict) else {},
        final=final if isinstance(final, dict) else {},
        diagnoses=[d for d in diagnoses or [] if isinstance(d, dict)],
    )

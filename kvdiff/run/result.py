"""What a compare run gives back (`CompareResult`), and its reports written into the run's folder:
shared by kvdiff's own engine's compare and an engine under test's (`engine_compare.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvdiff.analysis import Divergence
from kvdiff.analysis.report import Report


@dataclass
class CompareResult:
    """What a compare run produced: the divergence, its report and where its artefacts are."""

    divergence: Divergence
    report: Report = field(repr=False)    # megabytes for a real model: not in the repr
    out_dir: Path
    reference_trace: Path
    candidate_trace: Path
    report_json: Path
    report_html: Path

    @property
    def exit_code(self) -> int:
        return 0 if self.divergence.tokens_identical else 1

    @property
    def summary(self) -> str:
        """One line: verdict, first token flip, first divergence, diagnoses."""
        r = self.report
        if r.tokens_identical:
            return "tokens identical"
        parts = []
        flip = r.first("first_token_divergence")
        if flip:
            parts.append(f"tokens differ at step {flip['step']} ({flip['reference_token']!r} vs {flip['candidate_token']!r})")
        parts += parting_summary(r.first("first_divergence"), r.diagnoses)
        return "; ".join(parts) or "tokens differ"


def parting_summary(first_divergence: dict | None, diagnoses: list) -> list[str]:
    """Where two runs part beyond tolerance and what was diagnosed there, as parts of a summary line."""
    parts = []
    if first_divergence:
        parts.append(f"first divergence at layer {first_divergence['layer']} position {first_divergence['position']} "
                     f"{first_divergence['tensor']}")
    kinds = sorted({str(d.get("kind")) for d in diagnoses if isinstance(d, dict)})
    if kinds:
        parts.append("diagnoses: " + ", ".join(kinds))
    return parts


def write_reports(report: Report, out_dir: Path, json_path: Path | str | None,
                  html: Path | str | None) -> tuple[Path, Path]:
    """report.json and report.html into the run's folder, and the copies asked for; their paths."""
    from kvdiff.reports.html import write_html
    from kvdiff.reports.json_report import write_json_atomically

    report_json, report_html = out_dir / "report.json", out_dir / "report.html"
    write_json_atomically(report.to_json(), report_json)
    write_html(report, report_html)
    if json_path is not None:
        write_json_atomically(report.to_json(), Path(json_path))
    if html is not None:
        write_html(report, Path(html))
    return report_json, report_html

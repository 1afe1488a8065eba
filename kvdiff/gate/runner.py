"""Run gate cases like `kvdiff compare`, collect outcomes, write JUnit XML."""

from __future__ import annotations

import logging
import re
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvdiff.errors import KvdiffError
from kvdiff.files import write_text_atomically
from kvdiff.gate.cases import GateCase

log = logging.getLogger(__name__)


@dataclass
class CaseOutcome:
    """What one gate case gave: passed, failed (tokens differ) or error (it could not run)."""

    name: str
    status: str  # "passed" | "failed" | "error"
    seconds: float
    message: str
    report_dir: Path | None = None


def _case_dirnames(names: list[str]) -> list[str]:
    """A folder name per case: only safe characters, at most 100 of them, never '.' or '..', and
    distinct even where two case names differ only in characters that were replaced or cut."""
    out: list[str] = []
    for name in names:
        base = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")[:100] or "case"
        unique, n = base, 1
        while unique.lower() in (o.lower() for o in out):      # case-insensitive file systems
            n += 1
            unique = f"{base}-{n}"
        out.append(unique)
    return out


def run_cases(cases: list[GateCase], out_dir: Path, compare_fn: Callable | None = None,
              on_case: Callable[[CaseOutcome], None] | None = None) -> list[CaseOutcome]:
    """Run every case; a case that crashes is an error outcome and the others still run.

    Each case runs into its own folder under `out_dir`; folders of passing cases are removed,
    so what is left is one report folder per failing case.
    """
    from kvdiff.run.compare import compare

    compare_fn = compare_fn or compare
    models: dict = {}
    outcomes: list[CaseOutcome] = []
    for case, dirname in zip(cases, _case_dirnames([c.name for c in cases])):
        case_dir = out_dir / dirname
        start = time.perf_counter()
        try:
            result = compare_fn(case.messages, out=case_dir, model_cache=models, **case.options)
        except KvdiffError as exc:
            outcome = CaseOutcome(case.name, "error", time.perf_counter() - start, str(exc))
        except Exception as exc:  # a crashing case is reported; the rest of the gate still runs
            log.debug("case %s crashed", case.name, exc_info=True)     # the traceback goes after the message
            outcome = CaseOutcome(case.name, "error", time.perf_counter() - start, f"{type(exc).__name__}: {exc}")
        else:
            elapsed = time.perf_counter() - start
            failure = _failure(case, result)
            if failure is None:
                outcome = CaseOutcome(case.name, "passed", elapsed, "tokens identical")
                remove_tree(case_dir)
            else:
                outcome = CaseOutcome(case.name, "failed", elapsed, failure, case_dir)
        outcomes.append(outcome)
        if on_case is not None:
            on_case(outcome)
    return outcomes


def _failure(case: GateCase, result) -> str | None:
    """Why a case that ran fails: its tokens differ (cold and warm, for an engine under test), or, with
    `against_reference`, the engine's cold tokens differ from kvdiff's reference; None when it passes."""
    from kvdiff.run.result import parting_summary

    if not result.divergence.tokens_identical:
        return result.summary
    against = (result.report.to_json().get("engine_vs_reference") or {}) if case.against_reference else {}
    if against.get("tokens_identical", True):
        return None
    return "; ".join(["the engine's tokens differ from kvdiff's reference",
                      *parting_summary(against.get("first_divergence"), against.get("diagnoses") or [])])


def remove_tree(path: Path) -> None:
    """Delete the report folder of a check that passed (its traces are tens of megabytes)."""
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# Characters XML 1.0 cannot hold, even escaped (ElementTree writes them as they are).
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def write_junit(outcomes: list[CaseOutcome], path: Path, suite: str = "kvdiff-gate") -> None:
    """Write JUnit XML: one testcase per gate case, <failure> or <error> where it did not pass."""
    root = ET.Element(
        "testsuite",
        name=suite,
        tests=str(len(outcomes)),
        failures=str(sum(o.status == "failed" for o in outcomes)),
        errors=str(sum(o.status == "error" for o in outcomes)),
        time=f"{sum(o.seconds for o in outcomes):.3f}",
    )
    for o in outcomes:
        case = ET.SubElement(root, "testcase", classname=suite, name=o.name, time=f"{o.seconds:.3f}")
        if o.status == "failed":
            failure = ET.SubElement(case, "failure", message=o.message.splitlines()[0] if o.message else "")
            failure.text = o.message + (f"\nreport: {o.report_dir}" if o.report_dir else "")
        elif o.status == "error":
            ET.SubElement(case, "error", message=o.message).text = o.message
    path.parent.mkdir(parents=True, exist_ok=True)
    xml = ET.tostring(root, encoding="unicode", xml_declaration=True)
    xml = _NOT_XML.sub(lambda m: repr(m.group())[1:-1], xml)      # a case name may hold \x00: written as an escape
    write_text_atomically(path, xml + "\n", "the JUnit report")

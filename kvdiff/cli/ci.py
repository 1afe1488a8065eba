"""The commands CI runs: gate (cases that must give identical tokens) and bench."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from kvdiff.cli.app import app, command, console, for_humans, progress
from kvdiff.errors import InputError, KvdiffError
from kvdiff.files import check_outputs

log = logging.getLogger("kvdiff")


@app.command()
@command
def gate(
    cases_file: Path = typer.Argument(..., help=r"A TOML file of \[\[case]] tables."),   # \[: rich markup
    junit: Optional[Path] = typer.Option(None, "--junit", help="Write JUnit XML here."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Folder for the failing cases' reports."),
) -> None:
    """Run a file of cases as a CI gate: every case must give byte-identical tokens.

    Exit 0 when all pass, 1 when any case fails or errors.

    Example: kvdiff gate tests/gate/default.toml --junit gate.xml --out gate-reports
    """
    from kvdiff.gate.cases import load_cases

    check_outputs({"the JUnit XML": junit}, [cases_file], made_later=junit.parent if junit is not None else None)
    cases = load_cases(cases_file)      # before torch loads (seconds), for a quick error
    from rich.markup import escape
    from rich.table import Table

    from kvdiff.reports.printable import printable
    from kvdiff.run.folder import claimed_out_dir
    from kvdiff.gate.runner import run_cases, write_junit

    with claimed_out_dir(out, "gate") as out_dir, progress() as step:
        def announce(outcome):
            step(f"{outcome.name}: {outcome.status}")

        outcomes = run_cases(cases, out_dir, on_case=announce)
    if junit is not None:
        write_junit(outcomes, junit)
    table = Table(title=f"kvdiff gate: {cases_file}")
    for column in ("case", "result", "seconds", "detail"):
        table.add_column(column)
    colours = {"passed": "green", "failed": "red", "error": "yellow"}
    for o in outcomes:
        detail = o.message + (f" (report: {o.report_dir})" if o.report_dir else "")
        # case names and messages come from the case file: markup and control characters made inert
        table.add_row(escape(printable(o.name, keep="")), f"[{colours[o.status]}]{o.status}[/]", f"{o.seconds:.1f}",
                      escape(printable(detail)))
    if for_humans(junit):
        console().print(table)
    raise typer.Exit(0 if all(o.status == "passed" for o in outcomes) else 1)


BENCHMARKS_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
BENCHMARK_SKIPPED = 77      # a benchmark's exit status when this machine cannot run it (it prints why)


def available_benchmarks() -> dict[str, Path]:
    """The benchmarks of the source checkout, by name (bench_engine.py -> engine)."""
    return {p.stem.removeprefix("bench_"): p for p in sorted(BENCHMARKS_DIR.glob("bench_*.py"))}


@app.command()
@command
def bench(
    names: Optional[list[str]] = typer.Argument(None, metavar="[NAME]...", help="Benchmarks to run (default: all): "
                                                + (", ".join(available_benchmarks()) or "none in this install") + "."),
) -> None:
    """Run the project's benchmarks (benchmarks/bench_*.py in the source checkout) and print the figures.

    Example: kvdiff bench engine
    """
    import subprocess

    if not BENCHMARKS_DIR.is_dir():
        raise InputError(f"no benchmarks folder at {BENCHMARKS_DIR}: run `kvdiff bench` from a source checkout")
    available = available_benchmarks()
    chosen = names or list(available)
    unknown = [n for n in chosen if n not in available]
    if unknown:
        raise InputError(f"unknown benchmark(s) {', '.join(unknown)}: available are {', '.join(available)}")
    failed, skipped = [], []
    for name in chosen:
        log.info("running benchmark %s", name)
        status = subprocess.run([sys.executable, str(available[name])], check=False).returncode
        if status == BENCHMARK_SKIPPED:
            skipped.append(name)
        elif status != 0:
            failed.append(name)
    if skipped:
        log.warning("skipped benchmark(s) %s: this machine cannot run them (their reason is above)", ", ".join(skipped))
    if failed:
        raise KvdiffError(f"benchmark(s) {', '.join(failed)} failed: see their output above")

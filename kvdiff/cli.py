"""The `kvdiff` command line (typer). Errors become one line on stderr and an exit code."""

from __future__ import annotations

import errno
import functools
import logging
import os
import signal
from contextlib import contextmanager
import sys
import traceback
from pathlib import Path
from typing import Any, Optional, Sequence

import typer
from typer.core import TyperGroup

import kvdiff
from kvdiff.errors import InputError, KvdiffError
from kvdiff.files import check_outputs, is_stdout, stdout_gone

try:  # recent typer vendors click; older releases use click itself
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover - older typer
    from click.exceptions import ClickException

log = logging.getLogger("kvdiff")

# errno values that mean "no room to write": disk full, file size limit, quota.
_NO_SPACE = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


def _error_line(message: str) -> None:
    """Print `message` as the one error line on stderr (line breaks inside it become spaces,
    other control characters escapes)."""
    from kvdiff.reports.view import printable

    typer.echo("kvdiff: error: " + printable(" ".join(message.split()), keep=""), err=True)


def _is_logging_flag(token: str) -> bool:
    """-q, --quiet, --verbose, -v, -vv, ...: the group's options, which need no value."""
    return token in ("-q", "--quiet", "--verbose") or (len(token) > 1 and token[0] == "-" and set(token[1:]) == {"v"})


class _Commands(TyperGroup):
    """kvdiff's command group: a usage error is one line on stderr (exit 2), like every other error,
    and -q / -v work after the command name too."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        return super().parse_args(ctx, self._logging_flags_first(ctx, args))

    def _logging_flags_first(self, ctx: Any, args: list[str]) -> list[str]:
        """`kvdiff compare ... -q` read as `kvdiff -q compare ...`: click takes a group's options
        only before the command name. A token that is the value of the command's option
        (`--prompt -q`) stays where it is, and so does everything after `--`."""
        at = next((i for i, token in enumerate(args) if not token.startswith("-")), None)
        command = self.get_command(ctx, args[at]) if at is not None else None
        if command is None:
            return args
        takes_value = {opt for p in command.params if getattr(p, "param_type_name", "") == "option"
                       and not getattr(p, "is_flag", False) and not getattr(p, "count", False) for opt in p.opts}
        hoisted, rest, tokens = [], [], iter(args[at + 1:])
        for token in tokens:
            if token == "--":
                rest += [token, *tokens]
            elif _is_logging_flag(token):
                hoisted.append(token)
            else:
                rest.append(token)
                value = next(tokens, None) if token in takes_value else None
                if value is not None:
                    rest.append(value)
        return [*args[:at], *hoisted, args[at], *rest]

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except ClickException as exc:
            if type(exc).__name__ != "NoArgsIsHelpError":  # that one is the help, already printed
                ctx = getattr(exc, "ctx", None)
                where = f"; see `{ctx.command_path} --help`" if ctx is not None else ""
                _error_line(exc.format_message().rstrip(".") + where)
            sys.exit(exc.exit_code)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    name="kvdiff",
    cls=_Commands,
    help="Differential testing and KV-divergence debugging for chunked / cached LLM generation.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

_state = {"verbose": 0, "quiet": False}


def _configure_logging(verbose: int, quiet: bool) -> None:
    level = logging.WARNING if quiet else (logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING)
    # With -v each line starts with the seconds since start, so a log shows where a run's time goes.
    timed = "%(relativeCreated)8.0fms " if level < logging.WARNING else ""
    logging.basicConfig(level=level, format=timed + "%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("kvdiff").setLevel(level)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that it unwinds (and cleans up) as Ctrl-C does."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def _fail(message: str, code: int) -> None:
    _error_line(message)
    raise typer.Exit(code)


def command(func):
    """Run a command body, turning kvdiff errors into one stderr line and their exit code."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except typer.Exit:
            raise
        except KvdiffError as exc:
            if _state["verbose"]:
                traceback.print_exc()
            _fail(str(exc), exc.exit_code)
        except Terminated:
            _fail("terminated; no half-written output was kept", 128 + signal.SIGTERM)
        except KeyboardInterrupt:
            _fail("interrupted; no half-written output was kept", 130)
        except Exception as exc:  # a bug or an environment failure: still one line without -v
            if _state["verbose"]:
                traceback.print_exc()
            if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
                _fail(f"{os.strerror(exc.errno)} while writing: free disk space (or raise the file size limit), "
                      "then run again", 3)
            _fail(f"unexpected {type(exc).__name__}: {exc} (rerun with -v for the traceback)", 3)

    return wrapper


def _version(value: bool) -> None:
    if value:
        _echo(f"kvdiff {kvdiff.__version__}")
        raise typer.Exit(0)


@app.callback()
def main_options(
    verbose: int = typer.Option(0, "--verbose", "-v", count=True, help="More logging; -v also shows tracebacks."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only errors."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """kvdiff compares a chunked / cached generation path against the plain one."""
    _state["verbose"] = verbose
    _state["quiet"] = quiet
    _configure_logging(verbose, quiet)


@app.command()
@command
def generate(
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="The user message."),
    system: Optional[str] = typer.Option(None, "--system", "-s", help="An optional system message."),
    messages: Optional[Path] = typer.Option(None, "--messages", help="A JSON file of {role, content} messages."),
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Model name, folder or .gguf file."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", "-n", min=1, help="Tokens to generate."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda, cuda:N or auto."),
    device_map: Optional[str] = typer.Option(None, "--device-map", help="Split the model across the visible GPUs "
                                             "(auto, balanced, sequential); replaces --device."),
) -> None:
    """Generate greedily on the reference (continuous) path and print the answer.

    Example: kvdiff generate --system "You are a helpful assistant." --prompt "What is the capital of France?"
    """
    from kvdiff.engine.conversation import build_messages
    from kvdiff.engine.reference import reference_generate

    conversation = build_messages(prompt, system, messages)
    loaded_model, tokenizer = kvdiff.load_model(model, dtype=dtype, device=device, device_map=device_map)
    out = reference_generate(loaded_model, tokenizer, conversation, max_new_tokens)
    _echo(out.text)


_STRATEGY_HELP = "none, prefix, isolated-local, isolated-global, rerotate or blend."


def _echo(text: str) -> None:
    """`typer.echo` to stdout, which keeps going when the reader has gone."""
    try:
        typer.echo(text)
    except BrokenPipeError:
        stdout_gone()


def _console(stderr: bool = False):
    """A rich console on stdout (or stderr) that keeps going when the reader has gone."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            stdout_gone()

    return _Console(stderr=stderr, highlight=False)


@contextmanager
def _progress():
    """A transient spinner naming the current stage on a terminal's stderr; elsewhere (a pipe, a
    CI log) and with -q the stages go to the log (shown with -v), so stderr holds no spinner's
    leftovers."""
    console = _console(stderr=True)
    if _state["quiet"] or not console.is_terminal:
        yield lambda what: log.info("%s", what)
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("starting", total=None)
        yield lambda what: bar.update(task, description=what)


def _check_point(point: Optional[str]) -> None:
    """Refuse an unknown `--point` before any work (the heatmaps are of layer probe points)."""
    from kvdiff.probes.points import LAYER_POINTS

    if point is not None and point not in LAYER_POINTS:
        raise InputError(f"--point {point!r} is not a layer probe point: use one of {', '.join(LAYER_POINTS)}")


def _for_humans(*outputs: Optional[Path]) -> bool:
    """Whether the terminal report goes to stdout: not with -q, nor when one of `outputs` (report
    files) is written there (`-`, `/dev/stdout`)."""
    return not _state["quiet"] and not any(is_stdout(path) for path in outputs if path is not None)


def _show_report(report: dict, point: Optional[str]) -> None:
    from kvdiff.reports.terminal import render_terminal

    kwargs = {"point": point} if point else {}
    render_terminal(report, _console(), **kwargs)


@app.command()
@command
def compare(
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="The user message."),
    system: Optional[str] = typer.Option(None, "--system", "-s", help="An optional system message."),
    messages: Optional[Path] = typer.Option(None, "--messages", help="A JSON file of {role, content} messages."),
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Model name, folder or .gguf file."),
    strategy: str = typer.Option("prefix", "--strategy", help="Chunk strategy: " + _STRATEGY_HELP),
    numerics: str = typer.Option("exact", "--numerics", help="exact (batch-invariant) or fast (cascade attention)."),
    recompute_ratio: float = typer.Option(0.15, "--recompute-ratio", help="Share of chunk tokens blend recomputes."),
    chunk_size: Optional[int] = typer.Option(None, "--chunk-size", help="Cut the prompt into fixed N-token chunks."),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", "-n", help="Tokens to generate."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda, cuda:N or auto."),
    device_map: Optional[str] = typer.Option(None, "--device-map", help="Split the model across the visible GPUs "
                                             "(auto, balanced, sequential); replaces --device."),
    capture: Optional[str] = typer.Option(None, "--capture", help="Probe points to record, comma-separated (default all)."),
    layers: Optional[str] = typer.Option(None, "--layers", help="Layers to record, e.g. 0-3,29 (default all)."),
    warm: bool = typer.Option(False, "--warm", help="Run the conversation through the engine once first, so the "
                              "compared run reads its chunks from the cache."),
    warm_with: Optional[Path] = typer.Option(None, "--warm-with", help="A JSON file of messages the engine runs "
                                             "first instead (implies --warm): only the chunks they share are hits."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output folder (new or empty); default ./kvdiff-runs/<time>-<strategy>."),
    html: Optional[Path] = typer.Option(None, "--html", help="Also write the HTML report here."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write report.json here."),
    point: Optional[str] = typer.Option(None, "--point", help="Probe point of the terminal heatmap."),
) -> None:
    """Run the reference and the chunked engine with probes, and report where they part.

    Exit 0 when the tokens are identical, 1 when they differ.

    Example: kvdiff compare --system "You are a helpful assistant. Always answer in French." --prompt "What is the capital of France?" --strategy isolated-local
    """
    from kvdiff.compare import compare as run_compare
    from kvdiff.engine.conversation import build_messages

    _check_point(point)
    conversation = build_messages(prompt, system, messages)
    warm_up = build_messages(None, None, warm_with) if warm_with is not None else warm
    with _progress() as progress:
        result = run_compare(
            conversation, model=model, strategy=strategy, numerics=numerics, recompute_ratio=recompute_ratio,
            chunk_size=chunk_size, max_new_tokens=max_new_tokens, dtype=dtype, device=device, device_map=device_map,
            capture=capture, layers=layers, warm=warm_up, out=out, html=html, json_path=json_out, progress=progress,
        )
    log.info("artefacts in %s", result.out_dir)
    if _for_humans(html, json_out):
        _show_report(result.report, point)
        _echo(f"report: {result.report_html}")
    raise typer.Exit(result.exit_code)


@app.command()
@command
def diff(
    reference: Path = typer.Argument(..., help="The reference trace (.h5)."),
    candidate: Path = typer.Argument(..., help="The candidate trace (.h5)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write report.json (schema 1) to this file."),
    html: Optional[Path] = typer.Option(None, "--html", help="Write the HTML report to this file."),
    tolerance: list[str] = typer.Option([], "--tolerance", help="POINT=ATOL[,RTOL], repeatable."),
    baseline: Optional[Path] = typer.Option(None, "--baseline", help="Engine trace with strategy none, for attribution."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Model whose tokenizer shows token text (default: ids)."),
    point: Optional[str] = typer.Option(None, "--point", help="Probe point of the terminal heatmap."),
) -> None:
    """Diff two trace files: exit 0 if the tokens are identical, 1 if they differ.

    Works on traces from any engine that writes the trace format (docs/trace-format.md).

    Example: kvdiff diff run/reference.h5 run/candidate.h5 --json report.json --tolerance logits=1e-4,1e-3
    """
    from kvdiff.analysis import diff as run_diff, parse_tolerance
    from kvdiff.reports.json_report import write_json_atomically
    from kvdiff.reports.html import write_html

    _check_point(point)
    check_outputs({"report.json": json_out, "the HTML report": html},
                  [trace for trace in (reference, candidate, baseline) if trace is not None])
    tolerances = dict(parse_tolerance(spec) for spec in tolerance)
    tokenizer = kvdiff.load_model(model)[1] if model else None
    div = run_diff(reference, candidate, baseline=baseline, tolerances=tolerances, tokenizer=tokenizer)
    report = div.to_json()
    if json_out is not None:
        write_json_atomically(report, json_out)
    if html is not None:
        write_html(report, html)
    if _for_humans(html, json_out):
        _show_report(report, point)
        if report.get("attribution") is not None:
            _echo(f"attribution: {report['attribution']['source']}: {report['attribution']['evidence']}")
    raise typer.Exit(0 if div.tokens_identical else 1)


@app.command()
@command
def report(
    run_dir: Path = typer.Argument(..., help="A compare run folder holding report.json."),
    point: Optional[str] = typer.Option(None, "--point", help="Probe point of the terminal heatmap."),
) -> None:
    """Re-render the terminal and HTML reports of a compare run folder from its report.json.

    Example: kvdiff report kvdiff-runs/20261121-120000-isolated-local
    """
    import json

    from kvdiff.reports.html import write_html

    _check_point(point)
    if run_dir.exists() and not run_dir.is_dir():
        raise InputError(f"{run_dir} is not a folder: give the run folder that holds report.json "
                         f"(`kvdiff report {run_dir.parent}`)")
    path = run_dir / "report.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{run_dir} holds no report.json: give a folder written by `kvdiff compare`") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path} is not a kvdiff report ({exc})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path} is not a kvdiff report")
    if _for_humans():
        _show_report(data, point)
    write_html(data, run_dir / "report.html")
    raise typer.Exit(0 if data.get("tokens_identical") else 1)


@app.command()
@command
def inspect(
    trace: Path = typer.Argument(..., help="A trace file (.h5) written by kvdiff."),
) -> None:
    """Print what a trace file holds: model, chunks, tokens, probe points, layers and sizes.

    Example: kvdiff inspect run/reference.h5
    """
    from kvdiff.probes.inspect import describe_trace
    from kvdiff.probes.trace import open_trace

    with open_trace(trace) as tr:
        _console().print(describe_trace(tr))


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
    from rich.markup import escape
    from rich.table import Table

    from kvdiff.compare import claimed_out_dir
    from kvdiff.gate.cases import load_cases
    from kvdiff.gate.runner import run_cases, write_junit

    check_outputs({"the JUnit XML": junit}, [cases_file], made_later=junit.parent if junit is not None else None)
    cases = load_cases(cases_file)
    with claimed_out_dir(out, "gate") as out_dir, _progress() as progress:
        def announce(outcome):
            progress(f"{outcome.name}: {outcome.status}")

        outcomes = run_cases(cases, out_dir, on_case=announce)
    if junit is not None:
        write_junit(outcomes, junit)
    table = Table(title=f"kvdiff gate: {cases_file}")
    for column in ("case", "result", "seconds", "detail"):
        table.add_column(column)
    colours = {"passed": "green", "failed": "red", "error": "yellow"}
    for o in outcomes:
        detail = o.message + (f" (report: {o.report_dir})" if o.report_dir else "")
        table.add_row(escape(o.name), f"[{colours[o.status]}]{o.status}[/]", f"{o.seconds:.1f}", escape(detail))
    if _for_humans(junit):
        _console().print(table)
    raise typer.Exit(0 if all(o.status == "passed" for o in outcomes) else 1)


BENCHMARKS_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
BENCHMARK_SKIPPED = 77      # a benchmark's exit status when this machine cannot run it (it prints why)


@app.command()
@command
def bench(
    names: Optional[list[str]] = typer.Argument(None, help="Benchmarks to run (default: all), e.g. engine capture diff."),
) -> None:
    """Run the project's benchmarks (benchmarks/bench_*.py in the source checkout) and print the figures.

    Example: kvdiff bench engine
    """
    import subprocess

    if not BENCHMARKS_DIR.is_dir():
        raise InputError(f"no benchmarks folder at {BENCHMARKS_DIR}: run `kvdiff bench` from a source checkout")
    available = {p.stem.removeprefix("bench_"): p for p in sorted(BENCHMARKS_DIR.glob("bench_*.py"))}
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


def main() -> None:
    """Console-script entry point."""
    signal.signal(signal.SIGTERM, _raise_terminated)
    app()


if __name__ == "__main__":      # `python -m kvdiff.cli`, as `python -m kvdiff` and the `kvdiff` script
    main()

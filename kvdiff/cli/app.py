"""The `kvdiff` command group: errors as one line and an exit code, logging flags, output helpers.

The commands are in kvdiff.cli.commands and kvdiff.cli.ci; their shared options in kvdiff.cli.options."""

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

from kvdiff.version import __version__
from kvdiff.errors import InputError, KvdiffError
from kvdiff.files import is_stdout, stdout_gone

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
    from kvdiff.reports.printable import printable

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


class PrintableFormatter(logging.Formatter):
    """A log line whose message cannot forge other lines or restyle the terminal: its control
    characters, line breaks included, and line separators are written as escapes. A message
    may quote a trace, a case file or a model (a fingerprint holding a newline, a fake
    `kvdiff: error:` line and ESC[2J once cleared the terminal). Tracebacks (-v) stay as they are."""

    def format(self, record: logging.LogRecord) -> str:
        from kvdiff.reports.printable import printable

        original = record.msg, record.args
        record.msg, record.args = printable(record.getMessage(), keep=""), None
        try:
            return super().format(record)
        finally:
            record.msg, record.args = original


def _configure_logging(verbose: int, quiet: bool) -> None:
    level = logging.WARNING if quiet else (logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING)
    # With -v each line starts with the seconds since start, so a log shows where a run's time goes.
    timed = "%(relativeCreated)8.0fms " if level < logging.WARNING else ""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(PrintableFormatter(timed + "%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
    logging.getLogger("kvdiff").setLevel(level)
    _quiet_transformers()


def _quiet_transformers() -> None:
    """transformers' warnings and progress bars off: through the variables it reads when it loads,
    as importing it here would cost every command (an error line too) 1-2 s; directly where an
    embedding process has loaded it already."""
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if "transformers" in sys.modules or "huggingface_hub" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that it unwinds (and cleans up) as Ctrl-C does."""


def raise_terminated(signum, frame) -> None:
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
        echo(f"kvdiff {__version__}")
        raise typer.Exit(0)


@app.callback()
def main_options(
    verbose: int = typer.Option(0, "--verbose", "-v", count=True, metavar="", show_default=False,
                                help="More logging (-vv: debug); -v also shows tracebacks."),
    quiet: bool = typer.Option(False, "--quiet", "-q", metavar="", help="Only errors."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, metavar="",
                                 help="Print the version."),
) -> None:
    """kvdiff compares a chunked / cached generation path against the plain one."""
    _state["verbose"] = verbose
    _state["quiet"] = quiet
    _configure_logging(verbose, quiet)


def echo(text: str) -> None:
    """`typer.echo` to stdout, which keeps going when the reader has gone."""
    try:
        typer.echo(text)
    except BrokenPipeError:
        stdout_gone()


def console(stderr: bool = False):
    """A rich console on stdout (or stderr) that keeps going when the reader has gone."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            stdout_gone()

    return _Console(stderr=stderr, highlight=False)


@contextmanager
def progress():
    """A transient spinner naming the current stage on a terminal's stderr; elsewhere (a pipe, a
    CI log) and with -q the stages go to the log (shown with -v), so stderr holds no spinner's
    leftovers."""
    stderr = console(stderr=True)
    if _state["quiet"] or not stderr.is_terminal:
        yield lambda what: log.info("%s", what)
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=stderr, transient=True) as bar:
        task = bar.add_task("starting", total=None)
        yield lambda what: bar.update(task, description=what)


def check_point(point: Optional[str]) -> None:
    """Refuse an unknown `--point` before any work (the heatmaps are of layer probe points)."""
    from kvdiff.trace.points import LAYER_POINTS

    if point is not None and point not in LAYER_POINTS:
        raise InputError(f"--point {point!r} is not a layer probe point: use one of {', '.join(LAYER_POINTS)}")


def for_humans(*outputs: Optional[Path]) -> bool:
    """Whether the terminal report goes to stdout: not with -q, nor when one of `outputs` (report
    files) is written there (`-`, `/dev/stdout`)."""
    return not _state["quiet"] and not any(is_stdout(path) for path in outputs if path is not None)


def show_report(report, point: Optional[str]) -> None:
    from kvdiff.reports.terminal import render_terminal

    kwargs = {"point": point} if point else {}
    render_terminal(report, console(), **kwargs)

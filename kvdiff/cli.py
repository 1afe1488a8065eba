"""The `kvdiff` command line (typer). Errors become one line on stderr and an exit code."""

from __future__ import annotations

import functools
import logging
import sys
import traceback
from pathlib import Path
from typing import Optional

import typer

import kvdiff
from kvdiff.errors import KvdiffError, NotYetAvailableError

log = logging.getLogger("kvdiff")

app = typer.Typer(
    name="kvdiff",
    help="Differential testing and KV-divergence debugging for chunked / cached LLM generation.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

_state = {"verbose": 0}


def _configure_logging(verbose: int, quiet: bool) -> None:
    level = logging.WARNING if quiet else (logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("kvdiff").setLevel(level)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _fail(message: str, code: int) -> None:
    typer.echo(f"kvdiff: error: {message}", err=True)
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
        except KeyboardInterrupt:
            _fail("interrupted", 130)
        except Exception as exc:  # a bug or an environment failure: still one line without -v
            if _state["verbose"]:
                traceback.print_exc()
            _fail(f"unexpected {type(exc).__name__}: {exc} (rerun with -v for the traceback)", 3)

    return wrapper


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kvdiff {kvdiff.__version__}")
        raise typer.Exit(0)


@app.callback()
def main_options(
    verbose: int = typer.Option(0, "--verbose", "-v", count=True, help="More logging; -v also shows tracebacks."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only errors."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """kvdiff compares a chunked / cached generation path against the plain one."""
    _state["verbose"] = verbose
    _configure_logging(verbose, quiet)


def _not_yet(what: str, issue: int) -> None:
    raise NotYetAvailableError(f"`kvdiff {what}` is not available yet (tracked in issue #{issue})")


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
) -> None:
    """Generate greedily on the reference (continuous) path and print the answer.

    Example: kvdiff generate --system "You are a helpful assistant." --prompt "What is the capital of France?"
    """
    from kvdiff.engine.conversation import build_messages
    from kvdiff.engine.reference import reference_generate

    conversation = build_messages(prompt, system, messages)
    loaded_model, tokenizer = kvdiff.load_model(model, dtype=dtype, device=device)
    out = reference_generate(loaded_model, tokenizer, conversation, max_new_tokens)
    typer.echo(out.text)


@app.command()
@command
def compare() -> None:
    """Run the reference and the chunked engine with probes, and report where they part."""
    _not_yet("compare", 6)


@app.command()
@command
def diff() -> None:
    """Diff two trace files (reference, candidate)."""
    _not_yet("diff", 5)


@app.command()
@command
def report() -> None:
    """Re-render the reports of a compare run folder."""
    _not_yet("report", 6)


@app.command()
@command
def inspect(
    trace: Path = typer.Argument(..., help="A trace file (.h5) written by kvdiff."),
) -> None:
    """Print what a trace file holds: model, chunks, tokens, probe points, layers and sizes.

    Example: kvdiff inspect run/reference.h5
    """
    from rich.console import Console

    from kvdiff.probes.inspect import describe_trace
    from kvdiff.probes.trace import open_trace

    with open_trace(trace) as tr:
        Console().print(describe_trace(tr))


@app.command()
@command
def gate() -> None:
    """Run a file of cases as a CI gate: every case must give byte-identical tokens."""
    _not_yet("gate", 6)


@app.command()
@command
def bench() -> None:
    """Run the project's benchmarks and print the figures."""
    _not_yet("bench", 3)


def main() -> None:
    """Console-script entry point."""
    app()

"""The `kvdiff` command line (typer). Errors become one line on stderr and an exit code."""

import signal

from kvdiff.cli import ci, commands  # noqa: F401  (registers the commands on `app`)
from kvdiff.cli.app import app, raise_terminated

__all__ = ["app", "main"]


def main() -> None:
    """Console-script entry point."""
    signal.signal(signal.SIGTERM, raise_terminated)
    app()

"""Helpers of the robustness tests (docs/robustness.md): run the CLI, check the error contract.

The contract of every bad input or fault: exactly one line on stderr, `kvdiff: error: ...`, the
documented exit code (2 bad input, 3 runtime failure, 130 interrupted), no traceback without
`-v`, and nothing on disk that looks like a finished run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvdiff.cli import app
from kvdiff.run.folder import ARTEFACTS
from kvdiff.errors import TraceError
from kvdiff.trace import open_trace

REPO = Path(__file__).resolve().parent.parent
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]

_runner = CliRunner()


def cli(*args, **kwargs):
    """Invoke `kvdiff ARGS...` in this process (typer's CliRunner)."""
    return _runner.invoke(app, [str(a) for a in args], **kwargs)


def compare_args(out: Path | None = None, *extra) -> list:
    """`-q compare` on the tiny Llama with a short prompt, 2 new tokens, into `out`."""
    args = ["-q", "compare", "--model", "tiny-llama", "-n", "2", *extra]
    if "-p" not in extra and "--messages" not in extra:
        args += ["-p", "What is the capital of France?"]
    return args + (["--out", out] if out is not None else [])


def assert_error(result, code: int, *needles: str) -> str:
    """`result` (CliRunner result or CompletedProcess) failed with one error line naming `needles`."""
    exit_code = getattr(result, "exit_code", getattr(result, "returncode", None))
    stderr = result.stderr
    assert exit_code == code, (exit_code, stderr)
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvdiff: error: "), stderr
    assert "Traceback" not in stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def assert_no_finished_run(folder: Path) -> None:
    """`folder` is gone, or holds no artefact of a finished run and no trace that opens as complete."""
    if not folder.exists():
        return
    names = {p.name for p in folder.iterdir()}
    assert not names & set(ARTEFACTS), names
    for path in folder.glob("*.h5*"):
        with pytest.raises(TraceError):
            open_trace(path)


def trace_content(path: Path) -> dict[str, bytes]:
    """Every attribute and dataset of an HDF5 file as bytes, keyed by name (a trace's content)."""
    import h5py
    import numpy as np

    content: dict[str, bytes] = {}
    with h5py.File(path, "r") as f:
        def visit(name: str, obj) -> None:
            for key, value in obj.attrs.items():
                content[f"{name}@{key}"] = repr(value).encode()
            if isinstance(obj, h5py.Dataset):
                data = obj[()]
                raw = repr(data.tolist()).encode() if data.dtype.kind == "O" else np.ascontiguousarray(data).tobytes()
                content[name] = f"{obj.dtype}{obj.shape}".encode() + raw

        visit("/", f)
        f.visititems(visit)
    return content


def kvdiff_process(*args, **popen) -> subprocess.Popen:
    """`python -m kvdiff ARGS...` as a child process of this checkout (stdout and stderr piped)."""
    return subprocess.Popen([sys.executable, "-m", "kvdiff", *map(str, args)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def run_kvdiff(*args, timeout: float = 120, **popen) -> subprocess.CompletedProcess:
    """Run `python -m kvdiff ARGS...` to the end."""
    proc = kvdiff_process(*args, **popen)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

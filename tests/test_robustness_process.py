"""Robustness, process: SIGINT, SIGTERM and SIGKILL while capturing traces and while diffing them.

A child process runs the CLI with one stage slowed down (the first probed forward, or the diff's
comparison) so the signal lands inside that stage every time.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from synthetic import SyntheticModel, write_trace
from kvdiff.run.folder import CLAIM
from kvdiff.errors import TraceError
from kvdiff.trace import open_trace
from robustness import REPO, assert_error, assert_no_finished_run, cli, compare_args

pytestmark = pytest.mark.slow

# argv: marker file, then the kvdiff arguments. {stage} patches one stage to touch the marker and wait.
_DRIVER = textwrap.dedent("""
    import pathlib, signal, sys, time
    marker = pathlib.Path(sys.argv[1])
    # A test run started in the background inherits SIGINT ignored; a user's shell delivers it.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def hold(*args, **kwargs):
        marker.touch()
        time.sleep(120)

    {stage}
    from kvdiff.cli import main
    sys.argv = ["kvdiff", *sys.argv[2:]]
    main()
""")
CAPTURE = """
from kvdiff.probes.recorder import TraceRecorder
end_forward = TraceRecorder.end_forward
TraceRecorder.end_forward = lambda self: (end_forward(self), hold())
"""
DIFF = """
import kvdiff.analysis.api
kvdiff.analysis.api.compare = hold
"""


def interrupted(stage: str, how: signal.Signals, tmp_path: Path, *args) -> subprocess.CompletedProcess:
    """Run kvdiff with `stage` held, send `how` once the stage is reached, and collect the outcome."""
    marker = tmp_path / "reached"
    proc = subprocess.Popen([sys.executable, "-c", _DRIVER.format(stage=stage), marker, *map(str, args)],
                            cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 90
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), proc.communicate(timeout=10)
    proc.send_signal(how)
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("traces")
    model = SyntheticModel(layers=2, seed=3)
    return write_trace(model, root / "a.h5", list(range(3, 23)), 3), write_trace(model, root / "b.h5", list(range(3, 23)), 3)


@pytest.mark.parametrize("how, code, said", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")],
                         ids=["sigint", "sigterm"])
def test_sigint_or_sigterm_during_capture(tmp_path, how, code, said):
    run = tmp_path / "run"
    result = interrupted(CAPTURE, how, tmp_path, *compare_args(run))
    assert_error(result, code, f"{said}; no half-written output was kept")
    assert not run.exists()       # the folder the run created is removed with what it held


def test_sigkill_during_capture(tmp_path):
    run = tmp_path / "run"
    result = interrupted(CAPTURE, signal.SIGKILL, tmp_path, *compare_args(run))
    assert result.returncode == -signal.SIGKILL
    assert_no_finished_run(run)
    partial = [p for p in run.iterdir() if p.name != CLAIM]        # the killed run's claim stays too
    assert (run / CLAIM).exists()
    # digest capture's first pass writes reference.first.h5
    assert len(partial) == 1 and partial[0].name.startswith(".reference.") and partial[0].name.endswith(".partial")
    with pytest.raises(TraceError, match="incomplete|truncated|corrupt"):
        open_trace(partial[0])
    assert_error(cli(*compare_args(run)), 2, "already holds files")     # a rerun never mixes with it


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["sigint", "sigterm", "sigkill"])
def test_signal_during_diff(traces, tmp_path, how):
    report, page = tmp_path / "report.json", tmp_path / "report.html"
    result = interrupted(DIFF, how, tmp_path, "diff", *traces, "--json", report, "--html", page)
    if how == signal.SIGINT:
        assert_error(result, 130, "interrupted")
    elif how == signal.SIGTERM:
        assert_error(result, 143, "terminated")
    else:
        assert result.returncode == -signal.SIGKILL
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reached"]   # no report, no temporary file

"""Robustness, concurrency: two compares at once (the model cache case is in test_loading.py)."""

from __future__ import annotations

import pytest

from robustness import compare_args, kvdiff_process, trace_content

pytestmark = pytest.mark.slow


def test_two_compares_at_once_into_different_folders(tmp_path):
    runs = [tmp_path / "a", tmp_path / "b"]
    procs = [kvdiff_process(*compare_args(run, "--strategy", "isolated-local", "-n", "4")) for run in runs]
    outcomes = [proc.communicate(timeout=180) + (proc.returncode,) for proc in procs]
    assert [code for _, _, code in outcomes] == [1, 1], outcomes          # both ran to their verdict
    assert all(err == "" for _, err, _ in outcomes), outcomes
    a, b = runs
    assert (a / "report.json").read_bytes() == (b / "report.json").read_bytes()
    for name in ("reference.h5", "candidate.h5"):
        assert trace_content(a / name) == trace_content(b / name)

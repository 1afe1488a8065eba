"""Robustness, determinism: the same compare twice gives the same traces and the same reports."""

from __future__ import annotations

import pytest

from kvdiff.run.compare import compare
from robustness import MESSAGES, trace_content


@pytest.mark.parametrize("strategy, numerics", [("prefix", "exact"), ("isolated-local", "fast")])
def test_same_compare_twice_gives_identical_traces_and_reports(tmp_path, strategy, numerics):
    runs = [compare(MESSAGES, model="tiny-qwen3", strategy=strategy, numerics=numerics, max_new_tokens=3,
                    out=tmp_path / name) for name in ("first", "second")]
    first, second = (r.out_dir for r in runs)
    for name in ("reference.h5", "candidate.h5"):
        # Traces hold no timestamp (h5py does not track times by default), so the content is equal
        # bit for bit; the files themselves are byte-identical too today.
        assert trace_content(first / name) == trace_content(second / name), name
    # report.json and report.html hold no timestamp and no path of the run folder.
    for name in ("report.json", "report.html"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert str(first) not in (first / "report.json").read_text()

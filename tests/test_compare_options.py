import os

import pytest

from kvdiff.run.folder import prepare_out_dir
from kvdiff.run.options import RunOptions
from kvdiff.errors import InputError


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(strategy="bogus"), "unknown strategy 'bogus'"),
        (dict(numerics="approx"), "unknown numerics 'approx'"),
        (dict(max_new_tokens=0), "max_new_tokens must be between"),
        (dict(max_new_tokens=-3), "max_new_tokens must be between"),
        (dict(max_new_tokens=10**9), "max_new_tokens must be between"),
        (dict(recompute_ratio=1.5), "recompute_ratio must be in [0, 1]"),
        (dict(chunk_size=0), "chunk_size must be a positive"),
        (dict(capture="k,vv"), "unknown probe point(s) vv"),
        (dict(layers="0-x"), "bad layer '0-x' in '0-x'"),
        (dict(layers="3-1"), "bad layer range '3-1'"),
    ],
)
def test_bad_options_are_rejected_before_loading(kwargs, message):
    options = dict(strategy="prefix", numerics="exact", max_new_tokens=8, recompute_ratio=0.15, chunk_size=None)
    options.update(kwargs)
    with pytest.raises(InputError) as info:
        RunOptions.of(**options)
    assert message in str(info.value)


def test_out_dir_holding_an_earlier_run_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "report.json").write_text("{}")
    with pytest.raises(InputError, match="already holds files"):
        prepare_out_dir(run, "prefix")


def test_out_dir_new_or_empty_is_used(tmp_path):
    assert prepare_out_dir(tmp_path / "new", "prefix") == tmp_path / "new"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert prepare_out_dir(empty, "prefix") == empty


def test_default_out_dirs_never_mix_two_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = prepare_out_dir(None, "prefix")
    second = prepare_out_dir(None, "prefix")
    assert first != second and first.parent == second.parent == tmp_path / "kvdiff-runs"


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_out_dir(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    with pytest.raises(InputError, match="not writable"):
        prepare_out_dir(locked, "prefix")


def test_out_path_that_is_a_file(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(InputError, match="not a folder"):
        prepare_out_dir(target, "prefix")

"""Robustness, filesystem: unwritable or occupied output folders, disk full, failed report writes."""

from __future__ import annotations

import errno
import importlib
import json
import os
import resource
import shlex
import shutil
import stat
import subprocess
import sys
import threading

import pytest

from kvdiff.run.folder import ARTEFACTS, CLAIM
from kvdiff.errors import InputError
from kvdiff.files import write_text_atomically
from robustness import REPO, assert_error, assert_no_finished_run, cli, compare_args, run_kvdiff, trace_content


def test_output_path_that_is_a_file(tmp_path):
    (tmp_path / "run").write_text("x")
    assert_error(cli(*compare_args(tmp_path / "run")), 2, "exists and is not a folder")
    assert (tmp_path / "run").read_text() == "x"


def test_output_folder_holding_an_earlier_run_is_never_mixed_or_overwritten(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for name in ARTEFACTS:
        (run / name).write_text(f"earlier {name}")
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    result = cli(*compare_args(run, "--strategy", "isolated-local"))
    assert_error(result, 2, f"--out {run} already holds files (an earlier run?): choose a new folder or empty it")
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_output_folder_holding_a_killed_runs_partial_trace_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / ".reference.h5.4242.partial").write_bytes(b"\x89HDF")
    assert_error(cli(*compare_args(run)), 2, "already holds files")
    assert [p.name for p in run.iterdir()] == [".reference.h5.4242.partial"]



def test_an_output_folder_another_run_is_writing_is_refused_for_compare_and_gate(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / CLAIM).touch()                               # what a run writing into `run` keeps there
    assert_error(cli(*compare_args(run)), 2, f"--out {run} is being written by another kvdiff run",
                 f"one was killed: remove {run / CLAIM}")
    cases = tmp_path / "cases.toml"
    cases.write_text('[[case]]\nname = "a"\nprompt = "Hi"\nmodel = "tiny-llama"\nmax_new_tokens = 1\n')
    assert_error(cli("gate", cases, "--out", run), 2, "is being written by another kvdiff run")
    assert [p.name for p in run.iterdir()] == [CLAIM]


def test_a_run_claims_its_folder_until_it_ends_and_one_finished_meanwhile_is_not_mixed(tmp_path, monkeypatch):
    compare_module = importlib.import_module("kvdiff.run.folder")

    seen = []
    result = cli(*compare_args(tmp_path / "run"))
    assert result.exit_code == 0 and CLAIM not in {p.name for p in (tmp_path / "run").iterdir()}
    prepare = compare_module.prepare_out_dir

    def finished_meanwhile(out, label):         # another run ends between the emptiness check and the claim
        folder = prepare(out, label)
        (folder / "report.json").write_text("{}")
        seen.append(folder)
        return folder

    monkeypatch.setattr(compare_module, "prepare_out_dir", finished_meanwhile)
    assert_error(cli(*compare_args(tmp_path / "other")), 2, "already holds files")
    assert [p.name for p in seen[0].iterdir()] == ["report.json"]

def test_a_report_that_cannot_be_written_discards_the_whole_run(tmp_path, monkeypatch):
    """Disk full while writing report.html: exit 3, and neither traces nor report.json stay behind."""
    replace = os.replace

    def full(src, dst):
        if str(dst).endswith("report.html"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", full)
    assert_error(cli(*compare_args(tmp_path / "new")), 3, "cannot write the HTML report to", "No space left on device")
    assert not (tmp_path / "new").exists()      # the folder the run created goes too
    (tmp_path / "empty").mkdir()
    assert_error(cli(*compare_args(tmp_path / "empty")), 3, "No space left on device")
    assert list((tmp_path / "empty").iterdir()) == []     # a folder the user gave stays, empty again


@pytest.mark.slow
def test_disk_full_during_capture(tmp_path):
    """RLIMIT_FSIZE stands in for a full disk: writing the reference trace fails part-way."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    result = run_kvdiff(*compare_args(tmp_path / "run", "--trace-mode", "full"), preexec_fn=limit)   # MBs of rows
    assert_error(result, 3, "File too large")
    assert_no_finished_run(tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")
def test_output_folder_on_a_read_only_filesystem(tmp_path):
    """A read-only tmpfs in a private mount namespace: unwritable even for root."""
    ro, logs = tmp_path / "ro", tmp_path / "logs"
    ro.mkdir()
    logs.mkdir()
    kvdiff = shlex.join([sys.executable, "-m", "kvdiff", *map(str, compare_args())])
    script = (f"mount -t tmpfs -o ro,size=64k tmpfs {ro} || exit 99\n"
              f"{kvdiff} --out {ro}/run 2> {logs}/new; echo $? > {logs}/new.rc\n"
              f"{kvdiff} --out {ro} 2> {logs}/existing; echo $? > {logs}/existing.rc\n")
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=REPO, capture_output=True, timeout=120)
    if done.returncode == 99 or (done.returncode and not (logs / "new.rc").exists()):
        pytest.skip("cannot mount a tmpfs in a private mount namespace here")
    for name, message in (("new", f"cannot create output folder {ro}/run: Read-only file system"),
                          ("existing", f"output folder {ro} is not writable")):
        result = subprocess.CompletedProcess([], int((logs / f"{name}.rc").read_text()), "",
                                             (logs / name).read_text())
        assert_error(result, 2, message)


def test_report_json_to_stdout_is_all_that_stdout_holds(tmp_path):
    """`--json -` writes report.json to stdout and keeps the terminal report off it, so the output
    pipes into a JSON reader; the run folder still gets its own report.json, and no file named
    `-` is made."""
    result = run_kvdiff("compare", "--model", "tiny-llama", "-n", "2", "-p", "hi", "--out", tmp_path / "run",
                        "--json", "-")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["tokens_identical"] is True
    assert report == json.loads((tmp_path / "run" / "report.json").read_text())
    assert not (REPO / "-").exists()


def test_a_report_through_a_link_or_into_a_pipe_leaves_the_link_and_the_pipe(tmp_path):
    """The rename that makes a report appear whole replaces a link's file, not the link, and a
    pipe (or terminal, or /dev/stdout) is written in place: before, as root, `--json /dev/stdout`
    replaced the /dev/stdout link with a regular file."""
    kept = tmp_path / "kept.json"
    kept.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(kept)
    write_text_atomically(link, "new", "report.json")
    assert link.is_symlink() and kept.read_text() == "new"

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    write_text_atomically(fifo, "through the pipe", "report.json")
    reader.join(10)
    assert got == ["through the pipe"]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "kept.json", "link.json"]

    with pytest.raises(InputError, match="it is a folder"):
        write_text_atomically(tmp_path, "x", "report.json")


def test_a_report_copy_into_the_run_folder_the_run_makes(tmp_path):
    """`-o new --json new/x.json`: the folder does not exist before the run, which makes it."""
    run = tmp_path / "run"
    result = cli(*compare_args(run, "--json", run / "copy.json", "--html", run / "report.html"))
    assert result.exit_code == 0, result.stderr
    assert (run / "copy.json").read_text() == (run / "report.json").read_text()
    assert sorted(p.name for p in run.iterdir()) == sorted([*ARTEFACTS, "copy.json"])


@pytest.mark.parametrize("option, name", [("--json", "reference.h5"), ("--html", "candidate.h5"),
                                          ("--html", "report.json"), ("--json", "report.html")])
def test_a_report_copy_onto_another_file_of_the_run_is_refused_before_the_run(tmp_path, option, name):
    run = tmp_path / "run"
    assert_error(cli(*compare_args(run, option, run / name)), 2,
                 f"to {run / name}: this command also reads or writes that file; give another name")
    assert not run.exists()


def test_two_report_copies_onto_one_file_are_refused(tmp_path):
    result = cli(*compare_args(tmp_path / "run", "--json", tmp_path / "r", "--html", tmp_path / "r"))
    assert_error(result, 2, f"cannot write report.json to {tmp_path / 'r'}: this command also reads or writes")
    result = cli(*compare_args(tmp_path / "run", "--json", "-", "--html", "-"))
    assert_error(result, 2, "report.json and the HTML report cannot both go to stdout: give one of them a file name")
    assert not (tmp_path / "run").exists()


def test_diff_and_gate_never_write_over_what_they_read(tmp_path):
    """Before, `kvdiff diff a.h5 b.h5 --json b.h5` replaced the candidate trace with the report,
    and `kvdiff gate cases.toml --junit cases.toml` the cases with the XML."""
    run = tmp_path / "run"
    assert cli(*compare_args(run)).exit_code == 0
    traces = [run / "reference.h5", run / "candidate.h5"]
    before = {trace: trace_content(trace) for trace in traces}
    link = tmp_path / "link.h5"
    link.symlink_to(traces[1])
    for option, path in (("--json", traces[0]), ("--html", link)):
        assert_error(cli("diff", *traces, option, path), 2, "this command also reads or writes that file")
    assert {trace: trace_content(trace) for trace in traces} == before
    assert "(that is " in cli("diff", *traces, "--html", link).stderr

    cases = tmp_path / "cases.toml"
    cases.write_text('[[case]]\nname = "a"\nprompt = "Hi"\nmodel = "tiny-llama"\nmax_new_tokens = 1\n')
    assert_error(cli("gate", cases, "--junit", cases), 2, "cannot write the JUnit XML to")
    assert cases.read_text().startswith("[[case]]")


@pytest.mark.slow
def test_diff_writes_both_reports_or_neither_when_the_disk_fills(tmp_path):
    """RLIMIT_FSIZE between the two reports' sizes: report.json (~17 KB) fits, report.html (~37 KB)
    does not. Before, `diff --json A --html B` exited 3 but kept A, a report without its page."""
    from synthetic import SyntheticModel, write_trace

    model = SyntheticModel(layers=2, seed=1)
    traces = [write_trace(model, tmp_path / f"{name}.h5", list(range(3, 23)), 3) for name in ("a", "b")]
    (tmp_path / "kept.json").write_text("earlier")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (25_000, 25_000))

    for json_path in (tmp_path / "A.json", tmp_path / "kept.json"):
        result = run_kvdiff("diff", *traces, "--json", json_path, "--html", tmp_path / "B.html", preexec_fn=limit)
        assert_error(result, 3, "cannot write the HTML report to", "File too large")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.h5", "b.h5", "kept.json"]   # no A, no B, no temporary
    assert (tmp_path / "kept.json").read_text() == "earlier"

"""Robustness, security: traces are read without pickle or eval; reports keep hostile text inert."""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

import kvdiff
from synthetic import SyntheticModel, write_trace
from kvdiff.run.compare import compare
from robustness import assert_error, cli, run_kvdiff

PACKAGE = Path(kvdiff.__file__).parent
HOSTILE = "</script><img src=x onerror=alert(1)><style>*{display:none}</style>\u2028https://evil.example/x.js"


class _Payload:
    """Unpickling this creates `marker`: the proof that something was unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("traces")
    model = SyntheticModel(layers=2, seed=5)
    return write_trace(model, root / "a.h5", list(range(3, 23)), 2), write_trace(model, root / "b.h5", list(range(3, 23)), 2)


@pytest.mark.parametrize("where", ["json-attribute", "opaque-attribute", "opaque-dataset", "object-dataset"])
def test_pickled_or_object_data_in_a_trace_is_refused_and_never_unpickled(traces, tmp_path, where):
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(_Payload(marker))
    hostile = tmp_path / "hostile.h5"
    shutil.copy(traces[1], hostile)
    with h5py.File(hostile, "r+") as f:
        if where == "json-attribute":
            f.attrs["chunks_json"] = np.bytes_(payload)
        elif where == "opaque-attribute":
            f.attrs["messages_json"] = np.void(payload)
        else:
            rows = f["layers/0/k"].shape[0]
            del f["layers/0/k"]
            if where == "opaque-dataset":
                f["layers/0/k"] = np.array([np.void(payload)] * rows)
            else:
                column = np.empty(rows, dtype=object)
                column[:] = [np.frombuffer(payload, np.uint8)] * rows
                f.create_dataset("layers/0/k", data=column, dtype=h5py.vlen_dtype(np.uint8))
    for args in (("diff", traces[0], hostile), ("inspect", hostile)):
        line = assert_error(cli(*args), 2, str(hostile))
        assert "damaged" in line or "malformed" in line
    assert not marker.exists()


def test_kvdiff_never_unpickles_or_evaluates():
    """No pickle, marshal, shelve, eval, exec or numpy/torch loaders that unpickle, anywhere in kvdiff."""
    forbidden = re.compile(r"\b(import pickle|pickle\.|marshal\.|shelve\.|allow_pickle|torch\.load|yaml\.load)"
                           r"|(?<![.\w])(eval|exec)\(")
    hits = [f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}" for path in PACKAGE.rglob("*.py")
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if forbidden.search(line)]
    assert hits == []


def test_html_report_of_a_real_run_keeps_hostile_text_inert_and_loads_nothing(tmp_path):
    messages = [{"role": "system", "content": HOSTILE}, {"role": "user", "content": "What is " + HOSTILE}]
    result = compare(messages, model="tiny-llama", max_new_tokens=2, out=tmp_path / "run")
    page = result.report_html.read_text(encoding="utf-8")
    opening = '<script type="application/json" id="kvdiff-data">'
    start = page.index(opening) + len(opening)
    end = page.index("</script>", start)
    markup, data = page[:start] + page[end:], json.loads(page[start:end])["report"]
    assert "<img" not in page and "\u2028" not in page      # the hostile text never becomes markup
    assert markup.count("<script") == 2 and markup.count("<style>") == 1
    assert not re.search(r"\s(src|href|action|srcset|poster)\s*=|https?:|url\(|@import", markup)
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', markup).group(1)
    assert csp.replace("&#x27;", "'").startswith("default-src 'none';")
    assert HOSTILE.split("\u2028")[0] in "".join(data["prompt"]["tokens"])   # and survives as text


# ---- a trace never makes kvdiff read anything but itself (issue #28) -------------------------------

SECRET = b"SECRET-BYTES-FROM-ANOTHER-FILE\n" * 64


def _outward(kind: str, other: Path, secret: Path):
    """A change to a trace that points one of its objects (or an extra one) at another file."""
    def change(f: h5py.File) -> None:
        if kind == "extra-external-link":             # an object no rule reads: refused all the same
            f["notes"] = h5py.ExternalLink(str(other), "/")
            return
        ds = f["layers/0/k"]
        shape, dtype, attrs = ds.shape, ds.dtype, dict(ds.attrs)
        del f["layers/0/k"]
        if kind == "external-storage":                # HDF5 external raw storage: the rows' bytes in `secret`
            made = f.create_dataset("layers/0/k", shape=shape, dtype=dtype,
                                    external=[(str(secret), 0, int(np.prod(shape)) * dtype.itemsize)])
        elif kind == "external-link":
            f["layers/0/k"] = h5py.ExternalLink(str(other), "/layers/0/k")
            return
        elif kind == "soft-link":
            f["layers/0/k"] = h5py.SoftLink("/layers/1/k")
            return
        elif kind == "virtual-dataset":
            layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
            layout[:] = h5py.VirtualSource(str(other), "layers/0/k", shape=shape)
            made = f.create_virtual_dataset("layers/0/k", layout)
        else:                                         # a filter id HDF5 would look up as a plugin library
            made = f.create_dataset("layers/0/k", shape=shape, dtype=dtype, chunks=shape,
                                    compression=32001, compression_opts=(0, 0, 0, 0, 5, 1, 1), allow_unknown_filter=True)
        made.attrs.update(attrs)
    return change


OUTWARD = {
    "external-storage": "/layers/0/k keeps its bytes in external file(s)",
    "external-link": "/layers/0/k is an external link to",
    "soft-link": "/layers/0/k is a soft link to /layers/1/k",
    "virtual-dataset": "/layers/0/k is a virtual dataset",
    "extra-external-link": "/notes is an external link to",
    "plugin-filter": "/layers/0/k is compressed with HDF5 filter 32001, which HDF5 would load as a plugin",
}


@pytest.mark.parametrize("kind", list(OUTWARD))
def test_a_trace_reaching_outside_its_file_is_refused_before_anything_is_read(traces, tmp_path, kind):
    """Before, a dataset stored as external raw data of another file (/etc/passwd in the report)
    was read, and its bytes appeared as floats in report.json and report.html."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(SECRET)
    hostile = tmp_path / "hostile.h5"
    shutil.copy(traces[1], hostile)
    with h5py.File(hostile, "r+") as f:
        _outward(kind, traces[0], secret)(f)
    for args in (("diff", traces[0], hostile, "--json", tmp_path / "r.json", "--html", tmp_path / "r.html"),
                 ("diff", hostile, traces[0]), ("inspect", hostile)):
        assert_error(cli(*args), 2, f"trace {hostile} reaches outside its file: {OUTWARD[kind]}",
                     "kvdiff reads nothing but the trace file itself")
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "r.html").exists()
    with pytest.raises(kvdiff.InputError, match="reaches outside its file"):
        kvdiff.diff(traces[0], hostile)


# ---- text from a trace, a case file or a model is inert in every stream (issue #28) -----------------

FORGED = "x\nkvdiff: error: forged second line\x1b[2J\u2028\x85y"


@pytest.mark.slow
def test_a_warning_quoting_a_trace_stays_one_inert_line(traces, tmp_path):
    """A model fingerprint holding a newline, a fake `kvdiff: error:` line and ESC[2J forged a
    second error line and cleared the terminal when the warning printed it raw."""
    hostile = tmp_path / "hostile.h5"
    shutil.copy(traces[1], hostile)
    with h5py.File(hostile, "r+") as f:
        f.attrs["model_fingerprint"] = FORGED
    result = run_kvdiff("diff", traces[0], hostile, "--json", tmp_path / "r.json")
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("WARNING kvdiff.analysis.api: "), result.stderr
    assert "recorded with different weights" in lines[0] and "\\x1b[2J" in lines[0]
    assert not any(c in result.stderr for c in "\x1b\u2028\x85") and "\nkvdiff: error" not in result.stderr
    assert json.loads((tmp_path / "r.json").read_text())["metadata"]["candidate"]["model_fingerprint"] == FORGED


def test_every_log_line_of_the_cli_escapes_control_characters(caplog):
    """The CLI's log format escapes the message and its arguments, whoever logs them; a traceback
    (-v) keeps its lines."""
    import logging

    from kvdiff.cli.app import PrintableFormatter

    formatter = PrintableFormatter("%(levelname)s %(name)s: %(message)s")
    record = logging.LogRecord("kvdiff.gate.runner", logging.INFO, __file__, 1, "case %s: %s", (FORGED, "passed"), None)
    line = formatter.format(record)
    assert line == ("INFO kvdiff.gate.runner: case x\\nkvdiff: error: forged second line\\x1b[2J\\u2028\\x85y: passed")
    assert record.getMessage() == f"case {FORGED}: passed"          # the record itself is left as it was
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        record = logging.LogRecord("kvdiff", logging.ERROR, __file__, 1, "crashed\n", (), sys.exc_info())
    assert formatter.format(record).startswith("ERROR kvdiff: crashed\\n\nTraceback (most recent call last):\n")


def test_a_gate_case_name_prints_inert_in_the_table(tmp_path):
    """Case names come from the case file: the gate's table showed ESC sequences raw. (The case
    names a model that is not there: it ends as an error outcome at loading, at once.)"""
    cases = tmp_path / "cases.toml"
    cases.write_text('[[case]]\nname = "a\\u001b[2Jb\\nkvdiff: error: forged"\nprompt = "Hi"\n'
                     'model = "no-such-model\\u001b[31m"\n')
    result = cli("gate", cases, "--out", tmp_path / "out", env={"COLUMNS": "300"})
    assert result.exit_code == 1, result.output
    assert "\x1b" not in result.stdout and "a\\x1b[2Jb\\nkvdiff: error: forged" in result.stdout
    assert "no-such-model\\x1b[31m" in result.stdout

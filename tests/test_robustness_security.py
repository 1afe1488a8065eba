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
from robustness import assert_error, cli

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

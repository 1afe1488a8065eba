"""Robustness, traces: files that are not traces, damaged traces, mismatched pairs, NaN and Inf."""

from __future__ import annotations

import copy
import io
import json
import logging
import shutil
from pathlib import Path
from typing import Callable

import h5py
import numpy as np
import pytest
import torch
from rich.console import Console

import kvdiff
from synthetic import SyntheticModel, write_trace
from kvdiff.trace.points import ALL_POINTS
from kvdiff.trace.format import DTYPE_ATTR, to_storage
from kvdiff.reports import render_terminal
from kvdiff.analysis.report import Report
from robustness import assert_error, cli

PROMPT = list(range(3, 23))
MODEL = SyntheticModel(layers=2, seed=1)


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("traces")
    return {"reference": write_trace(MODEL, root / "reference.h5", PROMPT, 3),
            "same": write_trace(MODEL, root / "same.h5", PROMPT, 3)}


def mutated(traces, tmp_path: Path, change: Callable[[h5py.File], None], name: str = "cand.h5") -> Path:
    """A copy of the candidate trace with `change` applied to it (opened read-write)."""
    path = tmp_path / name
    shutil.copy(traces["same"], path)
    with h5py.File(path, "r+") as f:
        change(f)
    return path


def _set_cell(name: str, row: int, col: int, value: float) -> Callable[[h5py.File], None]:
    def change(f: h5py.File) -> None:
        data = f[name][()]
        data.reshape(data.shape[0], -1)[row, col] = value
        f[name][...] = data
    return change


# ---- files that are not (finished) traces ------------------------------------------------------

def _truncated(traces, tmp_path):
    data = traces["same"].read_bytes()
    (tmp_path / "cand.h5").write_bytes(data[: len(data) // 2])
    return tmp_path / "cand.h5"


def _file(data: bytes) -> Callable:
    def make(traces, tmp_path):
        (tmp_path / "cand.h5").write_bytes(data)
        return tmp_path / "cand.h5"
    return make


def _foreign(traces, tmp_path):
    with h5py.File(tmp_path / "cand.h5", "w") as f:
        f["x"] = np.zeros(3)
    return tmp_path / "cand.h5"


NOT_TRACES = {
    "missing": (lambda traces, tmp: tmp / "nope.h5", "not found: check the path, or record it first"),
    "a-folder": (lambda traces, tmp: tmp, "is not a file"),
    "empty-file": (_file(b""), "is not an HDF5 file"),
    "text-file": (_file(b"hello"), "is not an HDF5 file"),
    "truncated": (_truncated, "is truncated: HDF5 cannot open it; record it again"),
    "foreign-hdf5": (_foreign, "is an HDF5 file but not a kvdiff trace"),
    "incomplete": (lambda traces, tmp: mutated(traces, tmp, lambda f: f.attrs.__setitem__("complete", False)),
                   "is incomplete: its writer did not finish (killed or failed); record it again"),
    "newer-schema": (lambda traces, tmp: mutated(traces, tmp, lambda f: f.attrs.__setitem__("schema_version", 5)),
                     "has schema 5, newer than this kvdiff reads (1 to 4): upgrade kvdiff"),
}


@pytest.mark.parametrize("kind", list(NOT_TRACES))
def test_diff_and_inspect_refuse_what_is_not_a_finished_trace(traces, tmp_path, kind):
    make, message = NOT_TRACES[kind]
    bad = make(traces, tmp_path)
    assert_error(cli("diff", traces["reference"], bad, "--json", tmp_path / "r.json"), 2, message)
    assert_error(cli("inspect", bad), 2, message)
    assert not (tmp_path / "r.json").exists()


# ---- damaged traces: complete, but not what their metadata says ---------------------------------

def _drop(name: str) -> Callable[[h5py.File], None]:
    return lambda f: f.__delitem__(name)


def _shorten(name: str, rows: int) -> Callable[[h5py.File], None]:
    def change(f: h5py.File) -> None:
        data, attrs = f[name][:rows], dict(f[name].attrs)
        del f[name]
        f[name] = data
        f[name].attrs.update(attrs)
    return change


# The error line names what is damaged; its wording is the structure check's.
DAMAGED = {
    "declared-point-missing": (_drop("layers/1/q"), "layers/1/q"),
    "declared-layer-missing": (_drop("layers/1"), "layers/1"),
    "rows-missing": (_shorten("layers/0/k", 10), "layers/0/k"),
    "steps-missing": (_drop("steps"), "steps"),
    "attribute-missing": (lambda f: f.attrs.__delitem__("hidden_size"), "hidden_size"),
    "metadata-not-json": (lambda f: f.attrs.__setitem__("chunks_json", "{not json"), "Expecting property name"),
    "schema-not-a-number": (lambda f: f.attrs.__setitem__("schema_version", "one"), ""),
}


@pytest.mark.parametrize("kind", list(DAMAGED))
def test_damaged_trace_is_refused_not_a_crash(traces, tmp_path, kind):
    change, message = DAMAGED[kind]
    bad = mutated(traces, tmp_path, change)
    for args in (("diff", traces["reference"], bad), ("diff", bad, traces["reference"]), ("inspect", bad)):
        assert_error(cli(*args), 2, str(bad), message, "record it again")


# ---- pairs that do not match --------------------------------------------------------------------

@pytest.mark.parametrize("shape, message", [
    (dict(hidden=48, heads=6, kv_heads=3), "come from different models (hidden_size 48 vs 32)"),
    (dict(layers=3), "come from different models (num_layers 3 vs 2)"),
    (dict(vocab=80), "come from different models (vocab_size 80 vs 64)"),
], ids=["hidden-size", "layer-count", "vocabulary"])
def test_traces_of_differently_shaped_models_are_refused(traces, tmp_path, shape, message):
    other = write_trace(SyntheticModel(**{"layers": 2, "seed": 1, **shape}), tmp_path / "other.h5", PROMPT, 2)
    assert_error(cli("diff", traces["reference"], other), 2, message, "diff traces of the same model")


@pytest.mark.parametrize("attribute, what", [("model_fingerprint", "weights"), ("tokenizer_fingerprint", "tokenizers")],
                         ids=["weights", "tokenizers"])
def test_traces_of_other_weights_or_tokenizers_are_diffed_with_a_warning(traces, tmp_path, caplog, attribute, what):
    other = mutated(traces, tmp_path, lambda f: f.attrs.__setitem__(attribute, "other"))
    with caplog.at_level(logging.WARNING, logger="kvdiff"):
        div = kvdiff.diff(traces["reference"], other)
    assert div.tokens_identical
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and f"different {what} ({attribute} 'other' vs" in warned[0]    # quoted: trace text
    report = div.to_json()
    assert report["recorded_with_different"] == [what]
    console = Console(width=100, record=True, file=io.StringIO())
    render_terminal(Report.from_json(report), console)
    assert f"recorded with different {what}: differences may come from them" in console.export_text()


def test_weights_differ_only_where_the_fingerprints_can_tell():
    from dataclasses import replace

    from kvdiff.analysis.divergence import recorded_with_different
    from test_trace import make_meta

    ref = replace(make_meta(), model_fingerprint="cfg:a/w:1")
    assert recorded_with_different(ref, ref) == []
    assert recorded_with_different(ref, replace(ref, model_fingerprint="cfg:a/w:2")) == ["weights"]
    assert recorded_with_different(ref, replace(ref, model_fingerprint="cfg:a/wg:2")) == []       # host vs GPU hash
    assert recorded_with_different(ref, replace(ref, model_fingerprint="cfg:b/wg:2")) == ["weights"]  # other config
    assert recorded_with_different(ref, replace(ref, model_fingerprint="cfg:a/w:2", dtype="bfloat16")) == []
    assert recorded_with_different(ref, replace(ref, tokenizer_fingerprint="t2")) == ["tokenizers"]
    foreign = replace(ref, model_fingerprint="engine-x:1")       # another writer's: compared whole
    assert recorded_with_different(foreign, replace(ref, model_fingerprint="engine-x:2")) == ["weights"]
    assert recorded_with_different(foreign, ref) == ["weights"]


def _recast(dtype: str) -> Callable[[h5py.File], None]:
    """Re-store every probe dataset as if the run had been in `dtype`."""
    def change(f: h5py.File) -> None:
        names = []
        f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset)
                     and name.split("/")[0] in ("layers", "final") and name.split("/")[-1] in ALL_POINTS else None)
        for name in names:
            data, _ = to_storage(torch.from_numpy(f[name][()]).to(getattr(torch, dtype)))
            del f[name]
            f[name] = data
            f[name].attrs[DTYPE_ATTR] = dtype
        f.attrs["dtype"] = dtype
    return change


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_traces_of_different_dtypes_compare_at_the_looser_tolerance(traces, tmp_path, dtype):
    other = mutated(traces, tmp_path, _recast(dtype))
    report = kvdiff.diff(traces["reference"], other).to_json()
    assert report["metadata"]["candidate"]["dtype"] == dtype and report["metadata"]["reference"]["dtype"] == "float32"
    assert report["tolerances"]["default"] == {"float16": {"atol": 1e-5, "rtol": 1e-3},
                                               "bfloat16": {"atol": 1e-5, "rtol": 1.6e-2}}[dtype]
    assert report["tokens_identical"]
    json.dumps(report, allow_nan=False)


def test_one_model_recorded_in_float32_and_float16_gets_no_structural_diagnosis(tiny_llama, tmp_path):
    model, tokenizer = tiny_llama
    messages = [{"role": "user", "content": "hello there, how are you today my friend"}]
    ref = kvdiff.record(model, tokenizer, messages, tmp_path / "fp32.h5", max_new_tokens=8)
    cand = kvdiff.record(copy.deepcopy(model).to(torch.float16), tokenizer, messages, tmp_path / "fp16.h5",
                         max_new_tokens=8)
    report = kvdiff.diff(ref, cand).to_json()
    assert report["first_divergence"] is not None          # float16 rounding breaches the tolerance somewhere
    found = {d["kind"] for d in report["diagnoses"]}
    assert not found & {"position_mismatch", "missing_context", "cache_content_mismatch"}, report["diagnoses"]
    norms = [d for d in report["diagnoses"] if d["kind"] == "norm_consistency"]
    assert [d["source"] for d in norms] == ["inputs"] and norms[0]["explained_by_input_rounding"] > 0


def test_a_trace_recording_fewer_points_is_compared_on_the_shared_ones(traces, tmp_path):
    def drop_q(f: h5py.File) -> None:
        f.attrs["points"] = json.dumps([p for p in json.loads(f.attrs["points"]) if p != "q"])
        for layer in (0, 1):
            del f[f"layers/{layer}/q"]

    fewer = mutated(traces, tmp_path, drop_q)
    for ref, cand in ((traces["reference"], fewer), (fewer, traces["reference"])):
        report = kvdiff.diff(ref, cand).to_json()
        assert report["tokens_identical"] and "q" not in report["heatmaps"] and "k" in report["heatmaps"]


# ---- NaN and Inf: a finding, not a crash ------------------------------------------------------------

def _non_finite(traces, tmp_path, name: str, row: int, value: float, both: bool = False):
    cand = mutated(traces, tmp_path, _set_cell(name, row, 3, value))
    ref = mutated(traces, tmp_path, _set_cell(name, row, 3, value), "ref.h5") if both else traces["reference"]
    result = cli("diff", ref, cand, "--json", tmp_path / "report.json")
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    report = json.loads((tmp_path / "report.json").read_text())   # strict JSON: no NaN in the file
    return report, [d for d in report["diagnoses"] if d["kind"] == "non_finite"]


def test_nan_in_the_candidate_is_a_non_finite_diagnosis_naming_the_first_place(traces, tmp_path):
    report, found = _non_finite(traces, tmp_path, "layers/1/attn_out", 5, np.nan)
    assert len(found) == 1
    assert found[0]["layer"] == 1 and found[0]["tensor"] == "attn_out" and found[0]["positions"] == [5, 5]
    assert found[0]["traces"] == ["candidate"]
    assert "NaN or Inf first appears at layer 1 position 5 attn_out in the candidate" in found[0]["evidence"]
    assert [d["kind"] for d in report["diagnoses"]] == ["non_finite"]   # no other rule built on the NaN


def test_inf_in_the_final_logits_is_found_there(traces, tmp_path):
    report, found = _non_finite(traces, tmp_path, "final/logits", 7, np.inf)
    assert len(found) == 1 and found[0]["layer"] is None and found[0]["tensor"] == "logits"
    assert found[0]["positions"] == [7, 7] and report["first_divergence"]["tensor"] == "logits"


def test_nan_in_both_traces_at_the_same_place(traces, tmp_path):
    report, found = _non_finite(traces, tmp_path, "layers/0/v", 2, np.nan, both=True)
    assert len(found) == 1 and found[0]["traces"] == ["reference", "candidate"]
    assert found[0]["layer"] == 0 and found[0]["tensor"] == "v"


def test_report_of_a_folder_without_a_finished_run(tmp_path):
    assert_error(cli("report", tmp_path), 2, "holds no report.json: give a folder written by `kvdiff compare`")
    (tmp_path / "report.json").write_text("{\"verdict\": ")
    assert_error(cli("report", tmp_path), 2, "is not a kvdiff report")
    # the report file itself rather than its folder: before, `unexpected NotADirectoryError`, exit 3
    assert_error(cli("report", tmp_path / "report.json"), 2,
                 f"{tmp_path / 'report.json'} is not a folder: give the run folder that holds report.json "
                 f"(`kvdiff report {tmp_path}`)")


# ---- tables that disagree with the trace or with each other (issue #28) ---------------------------

def _chunks_json(*spans, encoded=None) -> Callable[[h5py.File], None]:
    table = [{"name": f"c{i}", "positions": list(span), "hash": "h", "cache": "miss",
              "encoded_positions": list(encoded or span)} for i, span in enumerate(spans)]
    return lambda f: f.attrs.__setitem__("chunks_json", json.dumps(table))


def _replace_dataset(name: str, values) -> Callable[[h5py.File], None]:
    def change(f: h5py.File) -> None:
        del f[name]
        f[name] = values
    return change


def _steps_cut(rows: int) -> Callable[[h5py.File], None]:
    def change(f: h5py.File) -> None:
        for name in list(f["steps"]):
            data = f[f"steps/{name}"][:rows]
            del f[f"steps/{name}"]
            f[f"steps/{name}"] = data
    return change


def _declared_length(name: str, length: int) -> Callable[[h5py.File], None]:
    """`name` declared `length` values long, chunked and unwritten: the file holds no bytes for them."""
    def change(f: h5py.File) -> None:
        del f[name]
        f.create_dataset(name, shape=(length,), maxshape=(None,), chunks=(1024,), dtype=np.int64)
    return change


INCONSISTENT = {
    # chunk tables: in the prompt (20 tokens), in order, without overlaps, encoded as long as they span
    "chunk-past-the-prompt": (_chunks_json((0, 10 ** 12)), "chunk 0 of chunks_json spans positions 0-1000000000000, "
                              "past the prompt's 20 tokens"),
    "chunks-overlapping": (_chunks_json((0, 9), (5, 19)), "chunk 1 of chunks_json starts at position 5, not after "
                           "chunk 0 (0-9): chunks are in order and do not overlap"),
    "chunks-repeated": (_chunks_json(*[(0, 0)] * 300_000), "chunk 1 of chunks_json starts at position 0"),
    "chunk-encoded-elsewhere-longer": (_chunks_json((0, 9), encoded=(0, 10 ** 12)),
                                       "chunk 0 of chunks_json is encoded at 1000000000001 positions"),
    # token lists, steps and positions
    "generated-ids-empty": (_replace_dataset("generated_ids", np.zeros(0, np.int64)),
                            "steps holds 3 rows for the 0 tokens of generated_ids"),
    "steps-cut": (_steps_cut(1), "steps holds 1 rows for the 3 tokens of generated_ids"),
    "step-token-differs": (lambda f: f["steps/token_id"].__setitem__(1, (f["steps/token_id"][1] + 1) % 64),
                           "steps/token_id must be the tokens of generated_ids: step 1 holds"),
    "step-position-differs": (lambda f: f["steps/position"].__setitem__(0, 3),
                              "steps/position must be the positions whose logits chose the tokens"),
    "positions-past-the-tokens": (_replace_dataset("positions", np.array([0, 1, 10 ** 12])),
                                  "positions holds 1000000000000, past the last of the 20 prompt and 3 generated"),
    "provenance-past-the-tokens": (lambda f: (f.create_group("provenance"), *[
        f.create_dataset(f"provenance/{k}", data=v) for k, v in (
            ("positions", np.array([10 ** 12])), ("chunk", np.array([b"x"], dtype=h5py.string_dtype())),
            ("prefill_id", np.zeros(1, np.int64)), ("encoded_position", np.zeros(1, np.int64)),
            ("reused", np.zeros(1, bool)))]), "provenance/positions holds 1000000000000, past the last"),
    # sizes over the sane limits, refused before anything is allocated
    "vocabulary-huge": (lambda f: f.attrs.__setitem__("vocab_size", 2 ** 40), "attribute 'vocab_size' is "
                        "1099511627776, outside 1..16777216"),
    "input-ids-declared-huge": (_declared_length("input_ids", 2 ** 40), "input_ids holds 1099511627776 values, "
                                "more than the 1048576 kvdiff reads"),
}


@pytest.mark.parametrize("kind", list(INCONSISTENT))
def test_tables_inconsistent_with_the_trace_are_refused_before_analysis(traces, tmp_path, kind):
    """Before: 300,000 chunks at [0, 0] took 207 s and 2.2 GB for a 68 MB report.html, a chunk
    spanning [0, 10^12] was accepted, an empty generated_ids gave `tokens differ from step 0` and
    /steps cut short gave exit 0."""
    change, message = INCONSISTENT[kind]
    bad = mutated(traces, tmp_path, change)
    for args in (("diff", traces["reference"], bad, "--json", tmp_path / "r.json"), ("inspect", bad)):
        assert_error(cli(*args), 2, f"trace {bad} is malformed: {message}", "fix its writer")
    assert not (tmp_path / "r.json").exists()


def test_a_long_chunk_table_is_looked_up_by_bisection():
    """One chunk per two prompt tokens: every position's chunk is found without a scan of the table
    (a scan per position made the diff and the terminal heatmap quadratic in the chunk count: about
    30 s for these 40,000 positions)."""
    import time

    from kvdiff.analysis.chunks import ChunkLookup
    from kvdiff.trace import ChunkRecord

    table = [ChunkRecord(f"c{i}", (2 * i, 2 * i + 1), "h", "miss", (0, 1)) for i in range(20_000)]
    lookup = ChunkLookup(table, np.arange(40_000), None)
    report = Report.from_json({"schema_version": 1, "verdict": "identical", "tokens_identical": True,
                               "chunks": [c.to_json() for c in table]})
    start = time.perf_counter()
    names = [lookup.chunk_of(p) for p in range(40_001)]
    labels = [report.chunk_at(p) for p in range(40_000)]
    assert time.perf_counter() - start < 5
    assert names[:3] == ["c0", "c0", "c1"] and names[-2:] == ["c19999", None]
    assert labels[::2] == [f"c{i}" for i in range(20_000)] == labels[1::2]


@pytest.mark.parametrize("change, message", [
    (lambda r: r.update(verdict={"x": 1}), "report 'verdict' must be 'identical' (tokens_identical is true), not dict"),
    (lambda r: r.update(verdict="divergent"), "report 'verdict' must be 'identical'"),
    (lambda r: r.update(tokens_identical="yes"), "report 'tokens_identical' must be true or false, not 'yes'"),
    (lambda r: r.update(chunks=[{"name": "a", "positions": ["x", 1]}]), "report chunk 0 positions must be [first, last]"),
    (lambda r: r["heatmaps"]["k"].update(rel=[[0.0]]), "report heatmaps 'k' rows must be lists as long as its positions"),
], ids=["verdict-a-dict", "verdict-contradicts", "identical-not-a-bool", "chunk-span-not-numbers", "heatmap-rows-short"])
def test_report_of_a_report_json_of_the_wrong_types_is_refused(traces, tmp_path, change, message):
    """Before, `kvdiff report` rendered a report.json whose verdict was a dict ("{'X': 1}" as the verdict)."""
    report = kvdiff.diff(traces["reference"], traces["same"]).to_json()
    change(report)
    (tmp_path / "report.json").write_text(json.dumps(report))
    assert_error(cli("report", tmp_path), 2, message, "is it a kvdiff report.json?")
    assert not (tmp_path / "report.html").exists()


def test_token_ids_shown_without_a_tokenizer_are_separated(traces, tmp_path):
    """Without --model the diff shows token ids; the terminal report glued them (`23327320163`)."""
    other = mutated(traces, tmp_path, lambda f: (f["generated_ids"].__setitem__(0, 6),
                                                 f["steps/token_id"].__setitem__(0, 6)))
    result = cli("diff", traces["reference"], other, env={"COLUMNS": "200"})
    assert result.exit_code == 1, result.stderr
    first, *rest = kvdiff.diff(traces["reference"], traces["same"]).reference.generated_ids.tolist()
    assert first != 6
    later = " ".join(map(str, rest))
    assert f"»{first}« {later}" in result.stdout and f"»6« {later}" in result.stdout

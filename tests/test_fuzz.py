"""Fuzzing, the short deterministic CI run: mutated traces fed to `kvdiff diff` and `inspect`, mutated
case files fed to `kvdiff gate`; none may crash (see tests/fuzz_targets.py for the property).

scripts/fuzz.py is the long run of the same targets. The tests after the fuzz runs pin the bugs
the fuzzer found, one input each.
"""

from __future__ import annotations

import json
import pickle
import re

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from typer.testing import CliRunner

import fuzz_targets
import kvdiff
from kvdiff.cli import app
from kvdiff.errors import TraceError
from kvdiff.trace import open_trace

# The CI profile: deterministic (derandomized, no example database), no deadline on a busy machine.
settings.register_profile("kvdiff-fuzz-ci", derandomize=True, database=None, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CI_EXAMPLES = {"diff": 120, "inspect": 80, "gate": 200}
runner = CliRunner()


@pytest.mark.parametrize("target", list(CI_EXAMPLES))
def test_fuzzed_inputs_never_crash_the_cli(target):
    profile = settings(settings.get_profile("kvdiff-fuzz-ci"), max_examples=CI_EXAMPLES[target])
    profile(fuzz_targets.fuzz_test(target))()


def test_the_property_flags_a_crash_into_the_catch_all(monkeypatch, tmp_path):
    """An unexpected exception inside a command must fail the fuzz property, not pass as exit 3."""
    def boom(*args, **kwargs):
        raise ZeroDivisionError("planted")

    monkeypatch.setattr("kvdiff.reports.inspect.describe_trace", boom)
    for digest in (False, True):          # a full trace, and a digest trace as `kvdiff compare` writes it
        with pytest.raises(fuzz_targets.FuzzFailure, match="catch-all"):
            fuzz_targets.run_inspect([], "candidate", digest)


# -- regressions: one input per bug the fuzzer found ---------------------------------------------

def _copy(tmp_path, name: str = "candidate"):
    path = tmp_path / f"{name}.h5"
    path.write_bytes(fuzz_targets.seeds()[name].path.read_bytes())
    return path


def _diff(tmp_path, candidate) -> tuple[int, str]:
    result = runner.invoke(app, ["diff", str(fuzz_targets.seeds()["reference"].path), str(candidate),
                                 "--json", str(tmp_path / "report.json")])
    fuzz_targets.check(result, ["diff"])
    return result.exit_code, result.stderr


def _malformed(path) -> str:
    with pytest.raises(TraceError) as info:
        open_trace(path)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_undecodable_text_is_malformed_not_printed(tmp_path):
    """Bytes that are not UTF-8 in a string attribute reach Python as lone surrogates, which crashed
    `kvdiff inspect` when printed."""
    path = _copy(tmp_path)
    with h5py.File(path, "r+") as f:
        f.attrs.create("strategy", b"\xc1prefix", dtype=h5py.string_dtype("utf-8"))
    assert "attribute 'strategy' is not UTF-8 text" in _malformed(path)
    result = runner.invoke(app, ["inspect", str(path)])
    fuzz_targets.check(result, ["inspect"])
    assert result.exit_code == 2


@pytest.mark.parametrize("attr, value, message", [
    ("format", np.array(["kvdiff-trace", "x"], dtype=h5py.string_dtype()), "not a kvdiff trace"),
    ("schema_version", "1", "'schema_version' must be an integer"),
    ("schema_version", -3, "'schema_version' is -3, outside"),
    ("schema_version", 2 ** 62, "newer than this kvdiff reads"),
    ("complete", np.array([True, True]), "incomplete"),
    ("num_layers", "two", "'num_layers' must be an integer"),
    ("num_kv_heads", 3, "not a multiple of num_kv_heads 3"),
    ("attn_scale", float("nan"), "'attn_scale' must be a finite number"),
    ("messages_json", "[{", "'messages_json' is not valid JSON"),
    ("chunks_json", json.dumps([{"name": "a", "hash": "h", "cache": "hit", "positions": [3, 1],
                                 "encoded_positions": [0, 0]}]), "positions must be [first, last]"),
    ("points", json.dumps(["k", "kk"]), "unknown probe point(s) ['kk']"),
    ("layers", np.array([0, 5]), "increasing ids in 0..1"),
    ("model_name", np.void(pickle.dumps(fuzz_targets.Unpicklable())), "'model_name' must be a string, not void"),
])
def test_malformed_attributes_are_one_line_trace_errors(tmp_path, attr, value, message):
    path = _copy(tmp_path)
    with h5py.File(path, "r+") as f:
        f.attrs[attr] = value
    assert message in _malformed(path)
    assert not fuzz_targets.Unpicklable.ran


@pytest.mark.parametrize("mutate, message", [
    (lambda f: f.__delitem__("layers/1/v"), "/layers/1/v is missing"),
    (lambda f: f.create_dataset("layers/0/extra", data=np.zeros(3)), "/layers/0 holds ['extra']"),
    (lambda f: f.create_group("layers/7"), "layers/ holds ['7']"),
    (lambda f: (f.__delitem__("final/logits"), f.create_dataset("final/logits", data=np.zeros((10, 5), np.float32))),
     "/final/logits has shape (10, 5), expected (10 or more, 32) rows"),
    (lambda f: f["layers/0/k"].attrs.__setitem__("kvdiff_dtype", "bfloat16"), "marked kvdiff_dtype='bfloat16'"),
    (lambda f: (f.__delitem__("layers/0/norm_stats/attn_norm/mean"), f.create_dataset("layers/0/norm_stats/attn_norm/mean", data=2.0)),
     "/layers/0/norm_stats/attn_norm/mean has shape ()"),
    (lambda f: (f.__delitem__("input_ids"), f.create_dataset("input_ids", data=np.array([1, 99]))),
     "input_ids holds values outside 0..31"),
    (lambda f: (f.__delitem__("positions"), f.create_dataset("positions", data=np.array([3, 2]))),
     "positions must be strictly increasing"),
    (lambda f: (f.__delitem__("steps/margin"), f.create_dataset("steps/margin", data=np.zeros((2, 2))))
     , "/steps/margin must be 1-D float"),
    (lambda f: (f.__delitem__("provenance/chunk"), f.create_dataset("provenance/chunk", data=np.zeros(8))),
     "/provenance/chunk must be a 1-D string dataset"),
    (lambda f: f.move("layers/0/norm_stats/attn_norm", "layers/0/norm_stats/bad\nname"), r"'bad\nname' is not a norm"),
])
def test_malformed_layouts_are_one_line_trace_errors(tmp_path, mutate, message):
    path = _copy(tmp_path)
    with h5py.File(path, "r+") as f:
        mutate(f)
    assert message in _malformed(path)


def test_an_error_line_escapes_line_breaks_and_control_characters(tmp_path):
    path = _copy(tmp_path)
    with h5py.File(path, "r+") as f:
        f.move("layers/0/norm_stats/attn_norm", "layers/0/norm_stats/x\n\x1b[31my\u2028")
    code, stderr = _diff(tmp_path, path)
    assert code == 2 and stderr.count("\n") == 1 and "\x1b" not in stderr and r"x\n\x1b[31my\u2028" in stderr


def test_unreadable_rows_are_a_damaged_trace_not_a_crash(tmp_path):
    """Flipping the bits of a chunk's address: HDF5 opens the file but cannot read those rows."""
    path = _copy(tmp_path)
    with h5py.File(path, "r") as f:
        info = f["layers/0/resid_pre"].id.get_chunk_info(0)
    data = bytearray(path.read_bytes())
    index = data.find(info.byte_offset.to_bytes(8, "little"))
    data[index + 6] ^= 0x09                      # the chunk address now points far past the file's end
    path.write_bytes(bytes(data))
    code, stderr = _diff(tmp_path, path)
    assert code == 2 and "is damaged: HDF5 cannot read /layers/0/resid_pre" in stderr


def _keep(path, points: tuple[str, ...], layers: tuple[int, ...]):
    fuzz_targets.Keep(points, layers).apply(path, fuzz_targets.seeds()["candidate"])
    return path


def test_traces_of_final_points_only_diff(tmp_path):
    """A trace recorded with --capture logits holds no layer groups (analysis/compare.py)."""
    ref = _keep(_copy(tmp_path, "reference"), ("logits",), (0, 1))
    cand = _keep(_copy(tmp_path), ("logits",), (0, 1))
    div = kvdiff.diff(ref, cand)
    assert div.comparison.layers == [] and set(div.comparison.final) == {"logits"}


def test_traces_with_layer_points_but_no_layers_diff(tmp_path):
    div = kvdiff.diff(_keep(_copy(tmp_path, "reference"), ("k", "logits"), ()), _keep(_copy(tmp_path), ("k", "logits"), ()))
    assert div.comparison.layers == [] and div.comparison.points == {}


def test_a_trace_without_positions_diffs(tmp_path):
    """Zero positions: empty rows (metrics.py) and an empty cache mask (diagnose_cache.py)."""
    path = _copy(tmp_path)
    fuzz_targets.SetIds("positions", ()).apply(path, fuzz_targets.seeds()["candidate"])
    code, _ = _diff(tmp_path, path)
    assert code in (0, 1)



def test_a_reference_whose_one_position_is_incomparable_diffs(tmp_path):
    """The reference holds position 8 alone, past the inputs both traces share: the keys' diagnoses
    get no comparable rows (rope.py's finite-row test took zero rows for a crash)."""
    path = _copy(tmp_path, "reference")
    fuzz_targets.SetIds("positions", (8,)).apply(path, fuzz_targets.seeds()["reference"])
    result = runner.invoke(app, ["diff", str(path), str(fuzz_targets.seeds()["candidate"].path),
                                 "--json", str(tmp_path / "report.json")])
    fuzz_targets.check(result, ["diff"])
    assert result.exit_code == 1

def test_huge_finite_rows_keep_their_metrics():
    """Squares of float32 elements beyond ~1e19 overflowed to a NaN rel for finite rows (metrics.py)."""
    from kvdiff.analysis.metrics import row_metrics

    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    y = x * np.float32(1.001)
    small, huge = row_metrics(x, y), row_metrics(x * np.float32(1e30), y * np.float32(1e30))
    assert huge.finite.all() and np.allclose(huge.rel, small.rel, rtol=1e-3) and np.allclose(huge.cosine, small.cosine)


@pytest.mark.parametrize("dtype", ["float16", "float64", "bfloat16"])
def test_traces_storing_a_point_in_different_dtypes_diff(tmp_path, dtype):
    """Rows of one point in float32 in one trace and another dtype in the other (metrics.py)."""
    path = _copy(tmp_path)
    seed = fuzz_targets.seeds()["candidate"]
    fuzz_targets.Recode(seed.objects.index("layers/0/k"), dtype).apply(path, seed)
    div = kvdiff.diff(fuzz_targets.seeds()["reference"].path, path)
    tier = div.comparison.points["k"].tier[0]
    assert (tier >= 0).all()


# -- NaN and Inf are findings; traces are never unpickled or evaluated -----------------------------

def _plant(path, dataset: str, position: int, value: float) -> None:
    with h5py.File(path, "r+") as f:
        rows = f[dataset][()]
        rows[position].reshape(-1)[0] = value
        f[dataset][()] = rows


def test_non_finite_names_the_first_place_in_dataflow_order(tmp_path):
    """Position first, then layer, then point: Inf at layer 1 position 5 comes before NaN at layer 0
    position 7, and the JSON report stays strict."""
    ref, cand = _copy(tmp_path, "reference"), _copy(tmp_path, "candidate")
    _plant(ref, "layers/0/q", 7, float("nan"))
    _plant(cand, "layers/1/mlp_out", 5, float("inf"))
    _plant(cand, "final/logits", 6, float("-inf"))
    div = kvdiff.diff(ref, cand)
    (nf,) = [d for d in div.diagnoses if d.kind == "non_finite"]
    assert nf.positions == (5, 5) and nf.details == {"layer": 1, "tensor": "mlp_out", "traces": ["candidate"]}
    assert "layer 1 position 5 mlp_out in the candidate" in nf.evidence
    json.dumps(div.to_json(), allow_nan=False)


def test_non_finite_in_both_traces_names_both(tmp_path):
    ref, cand = _copy(tmp_path, "reference"), _copy(tmp_path, "candidate")
    _plant(ref, "layers/0/v", 2, float("nan"))
    _plant(cand, "layers/0/v", 2, float("inf"))
    (nf,) = [d for d in kvdiff.diff(ref, cand).diagnoses if d.kind == "non_finite"]
    assert nf.positions == (2, 2) and nf.details["traces"] == ["reference", "candidate"]


def test_kvdiff_never_unpickles_or_evaluates(tmp_path):
    """No pickle, eval or exec in the package; h5py object references where ids belong are refused
    (a pickled attribute is refused as not a string: see the malformed attribute tests)."""
    sources = "\n".join(p.read_text() for p in sorted(fuzz_targets.Path(kvdiff.__file__).parent.rglob("*.py")))
    assert not re.search(r"\bpickle\b|allow_pickle|(?<![.\w])(eval|exec)\(|torch\.load|marshal", sources)
    path = _copy(tmp_path)
    with h5py.File(path, "r+") as f:
        del f["input_ids"]
        f.create_dataset("input_ids", data=np.array([f.ref] * 3, dtype=h5py.ref_dtype))
    assert "input_ids must be a 1-D integer dataset" in _malformed(path)


def test_gate_cases_get_distinct_folders_inside_the_output_folder(tmp_path):
    """Case names '.' and '..', and names that sanitize alike, once shared or escaped the folder
    (a passing '.' case removed every failing case's report)."""
    from types import SimpleNamespace

    from kvdiff.gate.cases import GateCase
    from kvdiff.gate.runner import run_cases

    def fake_compare(messages, out, model_cache, passes):
        out.mkdir(parents=True)
        (out / "report.json").write_text("{}")
        return SimpleNamespace(divergence=SimpleNamespace(tokens_identical=passes), summary="tokens differ")

    names = ["a b", "a_b", "A_B", "..", "a" * 300, "."]
    cases = [GateCase(name, [], {"passes": name == "."}) for name in names]
    outcomes = run_cases(cases, tmp_path / "gate", compare_fn=fake_compare)
    assert [o.status for o in outcomes] == ["failed"] * 5 + ["passed"]
    folders = [o.report_dir for o in outcomes[:5]]
    assert [f.name for f in folders] == ["a_b", "a_b-2", "A_B-3", "case", "a" * 100]
    assert all(f.parent == tmp_path / "gate" and (f / "report.json").exists() for f in folders)


def test_inspect_shows_trace_text_literally(tmp_path):
    """Rich markup in a trace's strings once crashed `kvdiff inspect` (MarkupError) or styled its output."""
    path = _copy(tmp_path)
    with h5py.File(path, "r+") as f:
        f.attrs["model_name"] = "[/bold] [red]x\n\x1b[31m"
    result = runner.invoke(app, ["inspect", str(path)])
    assert result.exit_code == 0 and r"[/bold] [red]x\n\x1b[31m" in result.stdout


def test_an_output_folder_name_too_long_is_an_input_error(tmp_path):
    """ENAMETOOLONG came from Path.exists() outside the handler (compare.py prepare_out_dir)."""
    from kvdiff.run.folder import prepare_out_dir

    with pytest.raises(kvdiff.InputError, match="cannot create output folder .*File name too long"):
        prepare_out_dir(tmp_path / ("a" * 300), "prefix")


def test_junit_xml_parses_whatever_the_case_names_hold(tmp_path):
    """A case name with \\x00 or \\uffff (valid TOML escapes) once made the JUnit file unparsable."""
    import xml.etree.ElementTree as ET

    from kvdiff.gate.runner import CaseOutcome, write_junit

    write_junit([CaseOutcome("a\x00b\x1b\uffff", "error", 0.1, "boom\x07")], tmp_path / "junit.xml")
    (case,) = ET.parse(tmp_path / "junit.xml").getroot().iter("testcase")
    assert case.attrib["name"] == r"a\x00b\x1b\uffff" and case.find("error").attrib["message"] == r"boom\x07"

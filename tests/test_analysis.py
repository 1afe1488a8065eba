"""The diff analyzer end to end on traces of the synthetic decoder, one planted fault per test."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

import kvdiff
from kvdiff.analysis import compare
from kvdiff.analysis.tolerance import NOT_COMPARED
from synthetic import Faults, SyntheticModel, write_trace
from kvdiff.errors import InputError, TraceError
from kvdiff.trace import ChunkRecord
from kvdiff.analysis.report import Report

PROMPT = list(range(3, 31))        # system 0-15, user 16-27, as in the seeds
STEPS = 5
USER = range(16, 28)
CHUNKS = [ChunkRecord("system", (0, 15), "s", "hit", (0, 15)), ChunkRecord("user", (16, 27), "u", "miss", (16, 27))]


@pytest.fixture(scope="module")
def model():
    return SyntheticModel(layers=3, seed=1)


@pytest.fixture(scope="module")
def traces(tmp_path_factory, model):
    """Reference plus one candidate per fault, written once for the module."""
    root = tmp_path_factory.mktemp("traces")
    runs = {
        "reference": ("reference", Faults()),
        "same": ("prefix", Faults()),
        "local": ("isolated-local", Faults(encoded={p: p - 16 for p in USER}, context_start={p: 16 for p in USER})),
        "global": ("isolated-global", Faults(context_start={p: 16 for p in USER})),
        "stale": ("prefix", Faults(stale={8: 2, 9: 3})),
        "norm": ("prefix", Faults(norm_eps={1: 10.0})),
        "noise": ("prefix", Faults(jitter=1e-7)),
        "nan": ("prefix", Faults(norm_eps={1: -1e9})),
        "none": ("none", Faults()),                       # baselines: the engine with reuse off
        "none_norm": ("none", Faults(norm_eps={1: 10.0})),
    }
    out = {}
    for name, (strategy, faults) in runs.items():
        chunks = None if name == "reference" else CHUNKS
        out[name] = write_trace(model, root / f"{name}.h5", PROMPT, STEPS, strategy=strategy, faults=faults, chunks=chunks)
    return out


def kinds(div) -> list[str]:
    return [d.kind for d in div.diagnoses]


def test_identical_traces_are_bitwise_everywhere(traces):
    div = kvdiff.diff(traces["reference"], traces["same"])
    assert div.tokens_identical and div.first_bit_difference is None and div.first_divergence is None
    assert div.diagnoses == []
    df = div.to_pandas()
    assert set(df["tier"]) == {"bitwise"} and len(df) == (3 * 12 + 2) * (len(PROMPT) + STEPS - 1)


def test_isolated_local_is_a_position_mismatch_with_offset_minus_16(traces):
    div = kvdiff.diff(traces["reference"], traces["local"])
    assert not div.tokens_identical
    assert (div.first_divergence.layer, div.first_divergence.position, div.first_divergence.chunk) == (0, 16, "user")
    pm = [d for d in div.diagnoses if d.kind == "position_mismatch"]
    assert len(pm) == 1 and pm[0].chunk == "user" and pm[0].positions == (16, 27)
    assert pm[0].details["offset"] == -16 and pm[0].details["encoded_positions"] == [0, 11]
    assert "offset -16" in pm[0].evidence


def test_keys_rotated_to_the_right_positions_but_rounded_differently_are_no_position_mismatch(traces, tmp_path):
    cand = tmp_path / "rope_rounding.h5"
    cand.write_bytes(traces["same"].read_bytes())
    with h5py.File(cand, "r+") as f:
        f["layers/0/k"][16:] = f["layers/0/k"][16:] * np.float32(1 + 1e-3)   # k_pre_rope untouched
    div = kvdiff.diff(traces["reference"], cand)
    assert (div.first_divergence.layer, div.first_divergence.position, div.first_divergence.tensor) == (0, 16, "k")
    assert "position_mismatch" not in kinds(div)


def test_isolated_global_is_missing_context_without_position_mismatch(traces):
    div = kvdiff.diff(traces["reference"], traces["global"])
    first = div.first_divergence
    assert (first.layer, first.position, first.tensor) == (0, 16, "z")
    assert "position_mismatch" not in kinds(div)
    mc = [d for d in div.diagnoses if d.kind == "missing_context"]
    assert len(mc) == 1 and mc[0].details["unattended"] == [0, 15] and mc[0].chunk == "user"
    assert 0 < mc[0].details["reference_attention_mass"] <= 1
    assert "0-15 were not attended" in mc[0].evidence


@pytest.mark.parametrize("chunks", [CHUNKS, None])
def test_attn_out_rounded_differently_is_no_missing_context(traces, tmp_path, model, chunks):
    cand = write_trace(model, tmp_path / "rounded.h5", PROMPT, STEPS, strategy="prefix", chunks=chunks)
    with h5py.File(cand, "r+") as f:
        f["layers/0/attn_out"][16:] = f["layers/0/attn_out"][16:] * np.float32(1 + 1e-3)   # q, k, v untouched
    div = kvdiff.diff(traces["reference"], cand)
    assert (div.first_divergence.layer, div.first_divergence.position, div.first_divergence.tensor) == (0, 16, "attn_out")
    assert "missing_context" not in kinds(div)


def test_missing_context_falls_back_to_the_data_without_a_chunk_table(traces, tmp_path, model):
    bare = write_trace(model, tmp_path / "bare.h5", PROMPT, STEPS, faults=Faults(context_start={p: 16 for p in USER}))
    div = kvdiff.diff(traces["reference"], bare)
    mc = [d for d in div.diagnoses if d.kind == "missing_context"]
    assert len(mc) == 1 and mc[0].chunk is None and mc[0].details["unattended"] == [0, 15]
    assert "differs from 16 on" in mc[0].evidence


def test_planted_stale_cache_slot_is_a_cache_content_mismatch_naming_the_source(traces):
    div = kvdiff.diff(traces["reference"], traces["stale"])
    cm = [d for d in div.diagnoses if d.kind == "cache_content_mismatch"]
    assert len(cm) == 1 and cm[0].positions == (8, 9) and cm[0].chunk == "system"
    assert cm[0].details["source_positions"] == [2, 3] and "8<-2" in cm[0].evidence
    assert div.first_divergence.position == 8 and div.first_divergence.tensor == "k_pre_rope"
    assert "position_mismatch" not in kinds(div) and "missing_context" not in kinds(div)


def test_context_differences_show_in_norm_statistics_but_come_from_inputs(traces):
    div = kvdiff.diff(traces["reference"], traces["global"])
    nc = [d for d in div.diagnoses if d.kind == "norm_consistency"]
    assert len(nc) == 1 and nc[0].details["source"] == "inputs"
    assert nc[0].details["stat_differences"] == nc[0].details["explained_by_inputs"] > 0


def test_a_norm_with_the_wrong_eps_is_blamed_on_the_norm_itself(traces):
    div = kvdiff.diff(traces["reference"], traces["norm"])
    nc = [d for d in div.diagnoses if d.kind == "norm_consistency"]
    assert len(nc) == 1 and nc[0].details["source"] == "norm"
    assert nc[0].details["candidate_inconsistent"]["layer"] == 1
    assert nc[0].details["candidate_inconsistent"]["norm"] == "attn_norm"
    assert div.first_divergence.layer == 1 and div.first_divergence.tensor == "attn_norm"


def test_rounding_noise_is_numerical_noise(traces):
    div = kvdiff.diff(traces["reference"], traces["noise"])
    assert div.tokens_identical and div.first_divergence is None
    assert div.first_bit_difference is not None and div.first_bit_difference.tensor == "z"
    assert kinds(div) == ["numerical_noise"]
    assert "within tolerance" in div.diagnoses[0].evidence


def test_a_tight_tolerance_turns_the_same_noise_divergent(traces):
    tight = {"attn_out": kvdiff.analysis.Tolerance(0.0, 0.0)}
    div = kvdiff.diff(traces["reference"], traces["noise"], tolerances=tight)
    assert div.first_divergence.tensor == "attn_out" and div.first_divergence.tier == "divergent"
    assert "numerical_noise" not in kinds(div)


def _flip_last_token(path, margin: float) -> None:
    """Change the last generated token (never fed back, so no tensor changes) and its margin; the
    step's top-1 becomes that token (a greedy run chooses its own top-1: else sampling_mismatch)."""
    with h5py.File(path, "r+") as f:
        f["generated_ids"][-1] = (f["generated_ids"][-1] + 1) % 64
        f["steps/token_id"][-1] = f["generated_ids"][-1]       # the step chose it: the reader checks they agree
        f["steps/margin"][-1] = margin
        top = f["steps/topk_ids"][-1]
        chosen = int(f["generated_ids"][-1])
        top[list(top).index(chosen) if chosen in top else 1], top[0] = top[0], chosen
        f["steps/topk_ids"][-1] = top


@pytest.mark.parametrize("margin,benign", [(1e-6, True), (3.0, False)])
def test_a_token_flip_on_a_near_tie_is_benign_noise(traces, tmp_path, model, margin, benign):
    ref = write_trace(model, tmp_path / "r.h5", PROMPT, STEPS)
    cand = write_trace(model, tmp_path / "c.h5", PROMPT, STEPS)
    _flip_last_token(cand, margin)
    with h5py.File(ref, "r+") as f:
        f["steps/margin"][-1] = margin
    div = kvdiff.diff(ref, cand)
    assert not div.tokens_identical and div.first_token_divergence.step == STEPS - 1
    assert div.first_divergence is None
    assert (kinds(div) == ["numerical_noise"]) == benign


def test_non_finite_values_are_a_finding_not_a_crash(traces):
    div = kvdiff.diff(traces["reference"], traces["nan"])
    nf = [d for d in div.diagnoses if d.kind == "non_finite"]
    assert len(nf) == 1 and nf[0].details["traces"] == ["candidate"] and nf[0].details["layer"] == 1
    json.dumps(div.to_json(), allow_nan=False)


def test_tokenization_mismatch_names_the_position_and_stops_comparison_there(traces, tmp_path, model):
    other = PROMPT[:5] + [60] + PROMPT[6:]
    cand = write_trace(model, tmp_path / "tok.h5", other, STEPS)
    div = kvdiff.diff(traces["reference"], cand)
    tm = [d for d in div.diagnoses if d.kind == "tokenization_mismatch"]
    assert len(tm) == 1 and tm[0].positions == (5, 5)
    assert tm[0].details == {"reference_token": "8", "candidate_token": "60"}
    assert div.comparable_until == 5 and div.first_divergence is None


def test_a_report_of_traces_of_different_prompts_says_so_first(traces, tmp_path, model):
    """Not "bitwise identical through every probe" and "tokens differ": the verdict names the
    first differing input, and traces without chunks name none (no "chunk None")."""
    import io

    from rich.console import Console

    from kvdiff.reports import render_terminal

    cand = write_trace(model, tmp_path / "tok.h5", PROMPT[:5] + [60] + PROMPT[6:], STEPS)
    report = kvdiff.diff(traces["reference"], cand).to_json()
    assert report["first_input_difference"] == 5 and report["recorded_with_different"] == []
    console = Console(width=100, record=True, file=io.StringIO())
    render_terminal(Report.from_json(report), console)
    text = console.export_text()
    assert "DIVERGENT — inputs differ from position 5" in text
    assert "the traces are of different prompts: positions from 5 on are not compared" in text
    assert "bitwise identical through every probe before position 5" in text
    assert "tokenization_mismatch" in text and "None" not in text
    heatmap_head = text.split("heatmap: ")[1].splitlines()[1]
    assert heatmap_head.split()[0] == "prompt"          # traces without chunks: the prompt, not "?"
    assert kvdiff.diff(traces["reference"], traces["reference"]).to_json()["first_input_difference"] is None


def test_a_divergence_prints_as_one_short_line(traces, tmp_path, model):
    cand = write_trace(model, tmp_path / "tok.h5", PROMPT[:5] + [60] + PROMPT[6:], STEPS)
    text = repr(kvdiff.diff(traces["reference"], cand))
    assert text.startswith("<Divergence divergent: ") and "\n" not in text and len(text) < 400
    assert "diagnoses tokenization_mismatch>" in text
    assert repr(kvdiff.diff(traces["reference"], traces["reference"])).startswith("<Divergence identical: ")


def test_traces_of_different_lengths_align_on_shared_positions(traces, tmp_path, model):
    short = write_trace(model, tmp_path / "short.h5", PROMPT, 2)
    div = kvdiff.diff(traces["reference"], short)
    td = div.first_token_divergence
    assert td.step == 2 and td.candidate_token_id is None and td.reference_token_id is not None
    report = div.to_json()
    assert report["alignment"]["only_reference"] == list(range(len(PROMPT) + 1, len(PROMPT) + STEPS - 1))
    assert div.first_bit_difference is None


def test_attribution_to_the_strategy_and_to_the_engine(traces):
    div = kvdiff.diff(traces["reference"], traces["global"], baseline=traces["none"])
    assert div.attribution.source == "strategy"
    div = kvdiff.diff(traces["reference"], traces["global"], baseline=traces["none_norm"])
    assert div.attribution.source == "engine" and "layer 1" in div.attribution.evidence


@pytest.mark.parametrize("baseline", ["reference", "global", "same"])
def test_a_baseline_that_is_not_the_engine_without_reuse_is_refused(traces, baseline):
    """Before, any trace was taken, and the evidence said "the baseline (same engine, strategy
    none)" of the reference itself or of the candidate."""
    with pytest.raises(InputError, match=f"baseline .*{baseline}.h5 was recorded with strategy .*; attribution needs "
                                         "the candidate's engine with strategy none"):
        kvdiff.diff(traces["reference"], traces["global"], baseline=traces[baseline])


def test_report_json_is_strict_and_has_the_contract_keys(traces):
    report = kvdiff.diff(traces["reference"], traces["local"]).to_json()
    text = json.dumps(report, allow_nan=False)
    assert json.loads(text)["schema_version"] == 1 and report["verdict"] == "divergent"
    for key in ("tokens_identical", "reference", "candidate", "prompt", "first_token_divergence",
                "first_bit_difference", "first_divergence", "diagnoses", "chunks", "heatmaps", "final",
                "comparable_until", "metadata"):
        assert key in report
    heat = report["heatmaps"]["k"]
    assert heat["layers"] == [0, 1, 2] and len(heat["rel"][0]) == len(heat["positions"])
    assert heat["tiers"][0][16] == "divergent" and heat["tiers"][0][0] == "bitwise"
    assert report["comparable_until"] == len(PROMPT) + report["first_token_divergence"]["step"]
    assert "incomparable" in heat["tiers"][0]
    assert report["candidate"]["strategy"] == "isolated-local" and report["chunks"][1]["name"] == "user"


def test_bad_inputs_are_one_line_errors(traces, tmp_path, model):
    with pytest.raises(TraceError):
        kvdiff.diff(traces["reference"], tmp_path / "missing.h5")
    wide = write_trace(SyntheticModel(layers=3, hidden=48, heads=6, kv_heads=3), tmp_path / "w.h5", PROMPT, 2)
    with pytest.raises(InputError, match="different models"):
        kvdiff.diff(traces["reference"], wide)


@pytest.mark.parametrize("name", ["local", "global", "stale", "norm", "noise", "nan"])
def test_reading_one_row_at_a_time_gives_the_same_result(traces, monkeypatch, name):
    whole = kvdiff.diff(traces["reference"], traces[name]).to_json()
    monkeypatch.setattr(compare, "_BLOCK_BYTES", (1, 1))
    assert kvdiff.diff(traces["reference"], traces[name]).to_json() == whole


def test_a_trace_that_stops_before_the_last_layer_does_not_check_the_final_norm_against_another_layer(
        tiny_llama, tmp_path):
    """The final norm reads the model's last layer: recorded without it (`--layers`, a zoom window),
    its check is not made, where it had taken the last recorded layer's rows for its input."""
    model, tokenizer = tiny_llama
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    paths = [kvdiff.record(model, tokenizer, messages, tmp_path / f"{numerics}.h5", max_new_tokens=2,
                           layers="0-1", numerics=numerics) for numerics in ("fast", "exact")]
    div = kvdiff.diff(*paths)
    assert model.config.num_hidden_layers == 3 and (div.comparison.final["final_norm"].tier != NOT_COMPARED).any()
    assert [n for n in div.comparison.norms if n.layer is None] == []
    assert "norm_consistency" not in {d.kind for d in div.diagnoses}

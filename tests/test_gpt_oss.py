"""gpt-oss (tiny-gpt-oss): sliding-window and global layers in turn, attention sinks, biased
projections, a top-k-then-softmax router and biased experts; every strategy, exact numerics,
router probes, position_mismatch and expert_flip named."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvdiff
from kvdiff.conversation import render_prompt_ids
from kvdiff.engine import Engine
from kvdiff.engine.numerics import exact_numerics
from kvdiff.engine.reference import reference_generate
from kvdiff.engine.tiny import build_tiny_model
from kvdiff.options import Strategy
from kvdiff.probes.model_meta import model_dims
from kvdiff.probes.recorder import TraceRecorder
from kvdiff.run.record import record
from kvdiff.trace import open_trace
from kvdiff.trace.points import ALL_POINTS, MOE_POINTS

from conftest import (SEED_MESSAGES, SHARING_SYSTEM, SEED_PROMPT, SEED_SYSTEM, assert_every_strategy_runs, assert_isolated_local_is_a_position_mismatch,
                      assert_prefix_exact_rows_are_the_forwards, assert_reference_is_transformers_generation,
                      assert_router_points_are_the_models,
                      planted_flip)

MESSAGES = SEED_MESSAGES
OTHER = SHARING_SYSTEM
LONG = [{"role": "system", "content": SEED_SYSTEM},
        {"role": "user", "content": SEED_PROMPT + " The quick brown fox jumps over the lazy dog." * 6}]


@pytest.fixture(scope="module")
def gpt_oss():
    return kvdiff.load_model("tiny-gpt-oss")


@pytest.fixture(scope="module")
def windowed():
    return build_tiny_model("tiny-gpt-oss", sliding_window=16)


def test_the_tiny_model_has_sinks_biases_both_layer_kinds_and_the_router_points(gpt_oss):
    model, _ = gpt_oss
    dims = model_dims(model)
    assert type(model).__name__ == "GptOssForCausalLM"
    assert model.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    attn = model.model.layers[0].self_attn
    assert all(p.abs().sum() > 0 for p in (attn.sinks, attn.q_proj.bias, attn.k_proj.bias, attn.o_proj.bias,
                                          model.model.layers[0].mlp.experts.down_proj_bias))
    assert (dims.num_experts, dims.experts_per_token) == (8, 2)
    assert set(dims.points()) >= set(ALL_POINTS + MOE_POINTS)


@pytest.mark.parametrize("numerics", ["fast", "exact"])
@pytest.mark.parametrize("strategy", [s.value for s in Strategy])
def test_every_strategy_runs(gpt_oss, strategy, numerics):
    assert_every_strategy_runs(*gpt_oss, strategy, numerics, MESSAGES, OTHER)


@pytest.mark.parametrize("numerics", ["fast", "exact"])
@pytest.mark.parametrize("strategy", ["prefix", "isolated-global", "blend"])
def test_strategies_run_past_a_16_position_window(windowed, strategy, numerics):
    model, tok = windowed
    assert len(render_prompt_ids(tok, LONG)) - len(render_prompt_ids(tok, LONG[:1])) > 16
    assert_every_strategy_runs(model, tok, strategy, numerics, LONG, OTHER)


@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_the_reference_is_transformers_own_generation_past_the_window(windowed, numerics):
    assert_reference_is_transformers_generation(*windowed, LONG, 12, numerics)


@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_the_engine_applies_the_sinks(gpt_oss, numerics):
    """Without its sinks the engine's tokens part from the reference's: the sinks are in every path."""
    model, tok = gpt_oss
    with exact_numerics(model) if numerics == "exact" else torch.no_grad():
        want = reference_generate(model, tok, MESSAGES, 12).token_ids
    eng = Engine(model, tok, numerics=numerics)
    for layer in eng.adapter.layers:
        layer.sinks = None
    assert eng.generate([MESSAGES], max_new_tokens=12)[0].token_ids != want


def test_prefix_exact_is_bitwise_the_reference_with_a_cached_system_prompt(gpt_oss, tmp_path):
    assert_prefix_exact_rows_are_the_forwards(*gpt_oss, "tiny-gpt-oss", MESSAGES, OTHER, tmp_path)


def test_reference_probes_hold_the_routers_logits_and_choices(gpt_oss, tmp_path):
    assert_router_points_are_the_models(*gpt_oss, MESSAGES, tmp_path)     # its choice: the top k of the logits


def test_the_traces_hold_the_sinks_attention_applied(gpt_oss, tmp_path):
    model, tok = gpt_oss
    with open_trace(record(model, tok, MESSAGES, tmp_path / "t.h5", max_new_tokens=3)) as tr:
        assert "attn_sinks" in tr.meta.points and tr.meta.dims.sinks == 1
        for layer in range(model.config.num_hidden_layers):
            rows = tr.layer(layer)["attn_sinks"]
            sinks = model.model.layers[layer].self_attn.sinks.detach().numpy()
            assert rows.shape[1:] == sinks.shape and (rows == sinks).all()


def test_a_sink_the_engine_misreads_is_where_the_traces_part(gpt_oss, tmp_path):
    model, tok = gpt_oss
    ref = record(model, tok, MESSAGES, tmp_path / "ref.h5", max_new_tokens=3, numerics="exact")
    eng = Engine(model, tok, numerics="exact")
    eng.adapter.layers[1].sinks = eng.adapter.layers[0].sinks          # layer 1 applies layer 0's sinks
    recorder = TraceRecorder.for_model(model, tok, MESSAGES, tmp_path / "cand.h5", strategy="prefix", numerics="exact")
    output = eng.generate([MESSAGES], max_new_tokens=3, sinks={0: recorder})[0]
    recorder.finish(output.token_ids, output.text, output.chunks)
    report = kvdiff.diff(ref, tmp_path / "cand.h5", tokenizer=tok).to_json()
    first, op = report["first_bit_difference"], report["first_operation"]
    assert (first["tensor"], first["layer"], first["position"]) == ("attn_sinks", 1, 0)
    assert (op["operation"], op["layer"], op["proved"]) == ("attention sinks (the layer's learned per-head logits)", 1, True)


def test_attention_that_leaves_its_sinks_out_is_named(gpt_oss, tmp_path, monkeypatch):
    # Written before the first run: the engine's attention drops the sinks it records (every layer);
    # q, k, v and attn_sinks match, z does not: attention_mismatch at layer 0, explanation "no sinks".
    from kvdiff.engine.attention_plan import ForwardAttention

    attend = ForwardAttention.attend
    monkeypatch.setattr(ForwardAttention, "attend", lambda self, pool, layer, window, q, scale, sinks=None, *a, **k:
                        attend(self, pool, layer, window, q, scale, None, *a, **k))
    model, tok = gpt_oss
    ref = record(model, tok, MESSAGES, tmp_path / "ref.h5", max_new_tokens=3, numerics="exact")
    recorder = TraceRecorder.for_model(model, tok, MESSAGES, tmp_path / "cand.h5", strategy="prefix", numerics="exact")
    output = Engine(model, tok, numerics="exact").generate([MESSAGES], max_new_tokens=3, sinks={0: recorder})[0]
    recorder.finish(output.token_ids, output.text, output.chunks)
    report = kvdiff.diff(ref, tmp_path / "cand.h5", tokenizer=tok).to_json()
    (d,) = [d for d in report["diagnoses"] if d["kind"] == "attention_mismatch" and d["positions"][0] == 0]
    assert (d["layer"], d["explanation"], d["inputs_match"]) == (0, "no sinks", True)
    assert d["fit_residual"] < 0.01 and "side" not in d


def test_isolated_local_is_a_position_mismatch(gpt_oss, tmp_path):
    report = assert_isolated_local_is_a_position_mismatch(*gpt_oss, "tiny-gpt-oss", MESSAGES, tmp_path)
    # YaRN scales RoPE's cos and sin: the keys' rotation is measured against the reference's own scale.
    assert not [d for d in report["diagnoses"] if d["kind"] == "rope_mismatch"]


def test_a_router_boosting_one_expert_at_one_token_is_named_expert_flip(gpt_oss, tmp_path):
    model, tok = gpt_oss
    layer, position = 1, 20
    report, ref_experts, logits = planted_flip(model, tok, MESSAGES, tmp_path, None, 1.0, layer, position)
    (d,) = [d for d in report["diagnoses"] if d["kind"] == "expert_flip"]
    ranked = np.argsort(-logits)
    assert (d["layer"], d["positions"], d["cause"]) == (layer, [position, position], "router")
    assert d["reference_experts"] == ref_experts == ranked[:2].tolist()
    assert d["candidate_experts"] == [int(ranked[2]), int(ranked[0])]
    assert d["router_margin"] == pytest.approx(float(logits[ranked[1]] - logits[ranked[2]]), rel=1e-6)
    assert report["first_divergence"]["tensor"] == "router_logits" and report["first_divergence"]["layer"] == layer


def test_sink_logits_scaled_in_decode_steps_are_named_with_their_factor(tmp_path, monkeypatch):
    """Red-team round 7, t04b: decode steps scaled every layer's sink logits by 20 (the recorded
    attn_sinks right). The fitted factor on the sinks explains attention's rows; before, nothing did,
    and o_proj of the next layer was blamed for the carried difference."""
    import kvdiff.engine.attention_plan as plan

    attend = plan.ForwardAttention.attend

    def scaled(self, pool, layer, window, q, scale, sinks=None):
        if sinks is not None and q.shape[0] == 1:
            sinks = sinks * 20
        return attend(self, pool, layer, window, q, scale, sinks)

    monkeypatch.setattr(plan.ForwardAttention, "attend", scaled)
    report = kvdiff.compare(SEED_MESSAGES, model="tiny-gpt-oss", strategy="none", max_new_tokens=4,
                            out=tmp_path / "run").report.to_json()
    found = [d for d in report["diagnoses"] if d["kind"] == "attention_mismatch" and d.get("explanation")]
    assert found and found[0]["explanation"] == "sinks scaled", report["diagnoses"]
    assert found[0]["sink_scale"] == pytest.approx(20, rel=1e-3) and found[0]["layer"] == 0

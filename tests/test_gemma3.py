"""Gemma 3 (tiny-gemma3): sliding-window and global layers with their own RoPE bases, q/k norms,
four norms a layer (post-norms recorded as points of their own), every strategy, exact numerics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Gemma3ForCausalLM

import kvdiff
from kvdiff.conversation import render_prompt_ids
from kvdiff.engine import Engine
from kvdiff.engine.tiny import tiny_config
from kvdiff.errors import UnsupportedModelError
from kvdiff.options import Strategy
from kvdiff.probes.model_meta import model_dims
from kvdiff.probes.recorder import TraceRecorder
from kvdiff.run.record import record
from kvdiff.trace import open_trace
from kvdiff.trace.points import MOE_POINTS, POST_NORM_POINTS

from conftest import SEED_MESSAGES, SHARING_SYSTEM, assert_every_strategy_runs, assert_isolated_local_is_a_position_mismatch, prefix_exact_run

MESSAGES = SEED_MESSAGES
OTHER = SHARING_SYSTEM


@pytest.fixture(scope="module")
def gemma():
    return kvdiff.load_model("tiny-gemma3")


def test_the_tiny_model_has_both_layer_kinds_and_declares_the_post_norms(gemma):
    model, _ = gemma
    dims = model_dims(model)
    assert isinstance(model, Gemma3ForCausalLM)
    assert model.config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    assert dims.post_norms == 1 and set(POST_NORM_POINTS) <= set(dims.points())
    assert not set(MOE_POINTS) & set(dims.points())
    assert model_dims(kvdiff.load_model("tiny-qwen3")[0]).post_norms == 0


@pytest.mark.parametrize("numerics", ["fast", "exact"])
@pytest.mark.parametrize("strategy", [s.value for s in Strategy])
def test_every_strategy_runs(gemma, strategy, numerics):
    assert_every_strategy_runs(*gemma, strategy, numerics, MESSAGES, OTHER)


def test_reference_probes_hold_the_four_norms(gemma, tmp_path):
    model, tok = gemma
    path = record(model, tok, MESSAGES, tmp_path / "t.h5", max_new_tokens=3)
    with open_trace(path) as tr:
        assert set(POST_NORM_POINTS) <= set(tr.meta.points)
        for layer in range(model.config.num_hidden_layers):
            rows = tr.layer(layer)
            assert np.array_equal(rows["resid_mid"], rows["resid_pre"] + rows["attn_post_norm"])
            assert np.array_equal(rows["resid_post"], rows["resid_mid"] + rows["mlp_post_norm"])
            assert set(tr.norm_stats(layer)) == {"attn_norm", "mlp_norm", "attn_post_norm", "mlp_post_norm"}
            # Norm weights are stored as the scale applied: Gemma's (1 + weight).
            weight, eps = tr.norm_weight(layer, "attn_post_norm")
            norm = model.model.layers[layer].post_attention_layernorm
            assert np.array_equal(weight, (1.0 + norm.weight.detach()).numpy()) and eps == norm.eps
            x = torch.from_numpy(rows["attn_out"])
            assert np.array_equal(rows["attn_post_norm"], norm(x).detach().numpy())
        ids = render_prompt_ids(tok, MESSAGES)
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        assert np.array_equal(tr.layer(1)["resid_pre"][: len(ids)], out.hidden_states[1][0].numpy())


def test_prefix_exact_is_bitwise_the_reference_with_a_cached_system_prompt(gemma, tmp_path):
    model, tok = gemma
    trace, output, ref, _ = prefix_exact_run(model, tok, "tiny-gemma3", MESSAGES, OTHER, tmp_path)
    computed = np.arange(output.chunks[1].positions[0], len(output.prompt_ids))
    with open_trace(trace) as tr:
        rows = np.searchsorted(tr.positions, computed)
        for layer in range(model.config.num_hidden_layers):
            assert np.array_equal(tr.point(layer, "resid_pre", rows), ref.hidden_states[layer][0, computed].numpy())
        assert np.array_equal(tr.point(None, "logits", rows), ref.logits[0, computed].numpy())


def test_isolated_local_is_a_position_mismatch(gemma, tmp_path):
    report = assert_isolated_local_is_a_position_mismatch(*gemma, "tiny-gemma3", MESSAGES, tmp_path)
    # The four norms recompute from the recorded inputs and weights: their differences come from the inputs.
    assert all(d["source"] == "inputs" for d in report["diagnoses"] if d["kind"] == "norm_consistency")


def test_a_global_layer_rotated_with_the_sliding_base_is_named_rope_at_that_layer(gemma, tmp_path):
    model, tok = gemma
    ref = record(model, tok, MESSAGES, tmp_path / "ref.h5", max_new_tokens=3, numerics="exact")
    eng = Engine(model, tok, numerics="exact")
    eng.adapter.layers[2].rope_kind = "sliding_attention"        # the global layer, with base 10,000
    recorder = TraceRecorder.for_model(model, tok, MESSAGES, tmp_path / "cand.h5", strategy="prefix", numerics="exact")
    output = eng.generate([MESSAGES], max_new_tokens=3, sinks={0: recorder})[0]
    recorder.finish(output.token_ids, output.text, output.chunks)
    report = kvdiff.diff(ref, tmp_path / "cand.h5", tokenizer=tok).to_json()
    op = report["first_operation"]
    assert (op["operation"], op["layer"], op["position"], op["proved"]) == ("RoPE (on q and k)", 2, 1, True)


@pytest.mark.parametrize("setting", ["final_logit_softcapping", "attn_logit_softcapping"])
def test_soft_capping_is_refused_in_one_line(gemma, setting):
    _, tok = gemma
    config = tiny_config("tiny-gemma3")
    setattr(config, setting, 30.0)
    with pytest.raises(UnsupportedModelError, match=setting) as err:
        Engine(Gemma3ForCausalLM(config), tok)
    assert "\n" not in str(err.value)

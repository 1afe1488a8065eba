"""DeepSeek-V3 (tiny-deepseek-v3): multi-head latent attention, whose cache holds a latent and a RoPE
key per token, and a mixture of experts after a dense first layer; every strategy, exact numerics,
the MLA probe points, position_mismatch, missing_context (attention recomputed from the latents
expanded with the trace's kv_b_proj) and expert_flip."""

from __future__ import annotations

import copy

import h5py
import numpy as np
import pytest
import torch
from transformers import DeepseekV3ForCausalLM

import kvdiff
from kvdiff.conversation import render_prompt_ids
from kvdiff.engine import Engine
from kvdiff.engine.latent_cache import LatentPool
from kvdiff.engine.tiny import build_tiny_model
from kvdiff.analysis.attention_fit import AttentionRows
from kvdiff.analysis.latent import expand
from kvdiff.errors import TraceError
from kvdiff.options import Strategy
from kvdiff.probes.model_meta import model_dims
from kvdiff.run.record import record
from kvdiff.trace import open_trace
from kvdiff.trace.format import DENSE_EXPERT
from kvdiff.trace.points import MOE_POINTS

from conftest import (SEED_MESSAGES, SHARING_SYSTEM, assert_every_strategy_runs, assert_isolated_global_is_missing_context,
                      assert_isolated_local_is_a_position_mismatch, moved_router_flip, prefix_exact_run)

MESSAGES = SEED_MESSAGES
OTHER = SHARING_SYSTEM


@pytest.fixture(scope="module")
def deepseek():
    return kvdiff.load_model("tiny-deepseek-v3")


def test_the_tiny_model_has_latent_attention_a_dense_layer_and_routed_ones(deepseek):
    model, tok = deepseek
    c, dims = model.config, model_dims(model)
    assert isinstance(model, DeepseekV3ForCausalLM) and c.rope_parameters["rope_type"] == "yarn" and c.rope_interleave
    assert not hasattr(model.model.layers[0].mlp, "gate") and hasattr(model.model.layers[1].mlp, "shared_experts")
    assert (dims.latent_dim, dims.rope_dim, dims.num_kv_heads, dims.head_dim) == (32, 8, 1, 24)
    assert (dims.num_experts, dims.experts_per_token) == (8, 2)
    assert "kv_latent" in dims.points() and "v" not in dims.points() and set(MOE_POINTS) <= set(dims.points())
    assert dims.point_shape("k") == dims.point_shape("k_pre_rope") == (1, 8) and dims.point_shape("q") == (4, 24)
    pool = Engine(model, tok).pool         # the cache holds a latent and a RoPE key a token, no per-head K or V
    assert isinstance(pool, LatentPool) and pool.k[0].shape[1:] == (1, 8) and pool.v[0].shape[1:] == (32,)


@pytest.mark.parametrize("numerics", ["fast", "exact"])
@pytest.mark.parametrize("strategy", [s.value for s in Strategy])
def test_every_strategy_runs(deepseek, strategy, numerics):
    assert_every_strategy_runs(*deepseek, strategy, numerics, MESSAGES, OTHER)


@pytest.mark.parametrize("overrides", [dict(q_lora_rank=None), dict(rope_interleave=False)],
                         ids=["q-projected-directly", "rope-in-halves"])
def test_prefix_exact_is_bitwise_without_q_lora_or_interleaved_rope(overrides, tmp_path):
    model, tok = build_tiny_model("tiny-deepseek-v3", **overrides)
    assert all(getattr(model.config, key) == value for key, value in overrides.items())
    prefix_exact_run(model, tok, "tiny-deepseek-v3", MESSAGES, OTHER, tmp_path)


def test_the_engine_generates_what_transformers_generate_does(deepseek):
    model, tok = deepseek
    ids = render_prompt_ids(tok, MESSAGES)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    want = out[0, len(ids):].tolist()
    got = Engine(model, tok).generate([MESSAGES], max_new_tokens=8)[0].token_ids
    assert got == want[: len(got)] and len(got) == min(8, len(want))


def test_reference_probes_hold_what_the_cache_holds(deepseek, tmp_path):
    model, tok = deepseek
    path = record(model, tok, MESSAGES, tmp_path / "t.h5", max_new_tokens=3)
    ids = render_prompt_ids(tok, MESSAGES)
    attn = model.model.layers[1].self_attn
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
    latent, rope_key = out.past_key_values.layers[1].keys, out.past_key_values.layers[1].values
    with open_trace(path) as tr, torch.no_grad():
        prompt = np.arange(len(ids))
        assert np.array_equal(tr.point(1, "kv_latent", prompt), latent[0, 0].numpy())
        assert np.array_equal(tr.point(1, "k", prompt)[:, 0], rope_key[0, 0].numpy())
        # before RoPE: kv_a_proj_with_mqa's last 8 columns, its interleaved pairs in rotate_half order
        pre = attn.kv_a_proj_with_mqa(torch.from_numpy(tr.point(1, "attn_norm", prompt)))[:, 32:]
        assert np.array_equal(tr.point(1, "k_pre_rope", prompt)[:, 0], torch.cat((pre[:, 0::2], pre[:, 1::2]), 1).numpy())
        # DeepSeek-V3's router logits, as its gate computes them (transformers 5.17 does not return them)
        gate = model.model.layers[1].mlp.gate
        logits = torch.nn.functional.linear(torch.from_numpy(tr.point(1, "mlp_norm", prompt)), gate.weight.float())
        assert np.array_equal(tr.point(1, "router_logits", prompt), logits.numpy())
        assert (tr.point(0, "experts", prompt) == DENSE_EXPERT).all() and not tr.point(0, "router_logits", prompt).any()


def test_prefix_exact_is_bitwise_the_reference_with_a_cached_system_prompt(deepseek, tmp_path):
    model, tok = deepseek
    trace, output, ref, cache = prefix_exact_run(model, tok, "tiny-deepseek-v3", MESSAGES, OTHER, tmp_path)
    computed = np.arange(output.chunks[1].positions[0], len(output.prompt_ids))
    with open_trace(trace) as tr:
        rows = np.searchsorted(tr.positions, computed)
        for layer in range(model.config.num_hidden_layers):
            assert np.array_equal(tr.point(layer, "resid_pre", rows), ref.hidden_states[layer][0, computed].numpy())
            assert np.array_equal(tr.point(layer, "kv_latent", rows), cache.layers[layer].keys[0, 0, computed].numpy())
        # the cached system prompt's rows were read, not computed: its latents are the reference's too
        cached = np.arange(output.chunks[0].positions[1] + 1)
        assert np.array_equal(tr.point(2, "kv_latent", np.searchsorted(tr.positions, cached)),
                              cache.layers[2].keys[0, 0, cached].numpy())
        assert np.array_equal(tr.point(None, "logits", rows), ref.logits[0, computed].numpy())


def test_isolated_local_is_a_position_mismatch(deepseek, tmp_path):
    assert_isolated_local_is_a_position_mismatch(*deepseek, "tiny-deepseek-v3", MESSAGES, tmp_path)


@pytest.mark.parametrize("warm", [False, True], ids=["computed", "read-from-the-cache"])
def test_isolated_global_is_missing_context(deepseek, warm, tmp_path):
    report = assert_isolated_global_is_missing_context(*deepseek, "tiny-deepseek-v3", MESSAGES, tmp_path, warm)
    (found,) = [d for d in report["diagnoses"] if d["kind"] == "missing_context"]
    if warm:        # the chunk's first token is the conversation's: alone, it holds the reference's latent
        assert found["confidence"] == 1.0 and "the reference's kv_latent of position 0" in found["evidence"]
    else:
        assert found["fit_residual"] <= 0.5 * found["next_best_residual"]


def test_attention_recomputed_from_the_traced_latents_and_kv_b_proj_is_the_models(deepseek, tmp_path):
    model, tok = deepseek
    path = record(model, tok, MESSAGES, tmp_path / "t.h5", max_new_tokens=3)
    nope = model.config.qk_nope_head_dim
    with open_trace(path) as tr, torch.no_grad():
        rows = np.arange(tr.positions.size)
        for layer in range(model.config.num_hidden_layers):
            attn = model.model.layers[layer].self_attn
            weight = tr.latent_weight(layer)
            assert np.array_equal(weight.reshape(-1, weight.shape[2]), attn.kv_b_proj.weight.numpy())
            latent, rope_key = tr.point(layer, "kv_latent", rows), tr.point(layer, "k", rows)
            k, v = expand(latent, rope_key, weight, nope)
            want_k, want_v = attn.expand_kv(torch.from_numpy(latent)[None, None], torch.from_numpy(rope_key[:, 0])[None, None])
            np.testing.assert_allclose(k, want_k[0].transpose(0, 1).numpy(), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(v, want_v[0].transpose(0, 1).numpy(), rtol=1e-5, atol=1e-6)
            out = tr.point(layer, "attn_out", rows)
            ref = AttentionRows(tr.point(layer, "q", rows), k, v, out, tr.meta.dims.attn_scale)
            z = np.stack([ref.attend(r, ref.raw_scores(r, r + 1), np.ones(r + 1, bool), 1.0) for r in rows])
            np.testing.assert_allclose(attn.o_proj(torch.from_numpy(z.astype(np.float32))).numpy(), out, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("damage", ["latent width", "no value columns", "layer out of range", "stray member",
                                    "router bias width", "uneven expert groups"])
def test_a_trace_with_a_malformed_kv_b_proj_or_routing_is_refused(deepseek, damage, tmp_path):
    model, tok = deepseek
    path = record(model, tok, MESSAGES, tmp_path / "t.h5", max_new_tokens=1)
    heads, nope = model.config.num_attention_heads, model.config.qk_nope_head_dim
    with h5py.File(path, "r+") as f:
        if damage == "layer out of range":
            f.move("weights/1", f"weights/{model.config.num_hidden_layers}")
        elif damage == "stray member":
            f["weights/1/o_proj"] = np.zeros(3, np.float32)
        elif damage == "router bias width":
            del f["weights/1/router_bias"]
            f["weights/1/router_bias"] = np.zeros(7, np.float32)
        elif damage == "uneven expert groups":
            f.attrs["expert_groups"] = 3
        else:
            del f["weights/1/kv_b_proj"]
            shape = (heads, nope + 4, 33) if damage == "latent width" else (heads, nope, 32)
            f["weights/1/kv_b_proj"] = np.zeros(shape, np.float32)
    with pytest.raises(TraceError, match="malformed"):
        open_trace(path)


def test_a_moved_router_weight_in_the_engine_is_named_expert_flip(deepseek, tmp_path):
    model, tok = deepseek
    layer = model.config.num_hidden_layers - 1
    report, flipped, moved = moved_router_flip(model, tok, MESSAGES, tmp_path, layer, expert=3)
    assert flipped.size                                       # the moved weights flip some tokens
    (d,) = [d for d in report["diagnoses"] if d["kind"] == "expert_flip"]
    assert (d["layer"], d["positions"][0], d["cause"]) == (layer, int(flipped[0]), "router")
    assert d["candidate_experts"] == moved[flipped[0]].tolist()


def test_an_expert_flips_router_margin_is_deepseeks_choice_sigmoid_plus_bias_in_the_best_groups(deepseek, tmp_path):
    model, tok = deepseek
    biased, layer = copy.deepcopy(model), model.config.num_hidden_layers - 1
    with torch.no_grad():
        for block in biased.model.layers[model.config.first_k_dense_replace:]:
            block.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(8, generator=torch.Generator().manual_seed(2)))
    report, flipped, _ = moved_router_flip(biased, tok, MESSAGES, tmp_path, layer, expert=3)
    (d,) = [d for d in report["diagnoses"] if d["kind"] == "expert_flip"]
    gate, k = copy.deepcopy(biased.model.layers[d["layer"]].mlp.gate), model.config.num_experts_per_tok
    gate.top_k = k + 1                          # the model's own choice, one expert further: the (k+1)-th
    with open_trace(tmp_path / "ref.h5") as tr, torch.no_grad():
        assert np.array_equal(tr.router_bias(d["layer"]), gate.e_score_correction_bias.numpy())
        h = torch.from_numpy(tr.point(d["layer"], "mlp_norm", np.array([d["positions"][0]])))
        logits, _, chosen = gate(h)
    choice = (logits.sigmoid() + gate.e_score_correction_bias)[0, chosen[0]].sort(descending=True).values
    raw = logits[0].sort(descending=True).values
    assert d["router_margin"] == pytest.approx(float(choice[k - 1] - choice[k]), rel=1e-5)
    assert d["router_margin"] != pytest.approx(float(raw[k - 1] - raw[k]), rel=1e-2)
    assert "sigmoid of the logits plus the router's bias" in d["evidence"]


def test_latents_kept_in_bfloat16_are_the_latent_projection_stored_so(deepseek, tmp_path, monkeypatch):
    """Red-team round 7, t06: the engine rounds every layer's latent (what the cache holds) to
    bfloat16; kv_latent had no operation, so nothing was claimed past a norm verdict."""
    import kvdiff.engine.adapters as adapters

    qkv = adapters.DeepseekV3Adapter.qkv

    def rounded(self, layer, h):
        q, k, latent = qkv(self, layer, h)
        return q, k, latent.to(torch.bfloat16).to(latent.dtype)

    monkeypatch.setattr(adapters.DeepseekV3Adapter, "qkv", rounded)
    report = kvdiff.compare(MESSAGES, model="tiny-deepseek-v3", strategy="none", max_new_tokens=4,
                            out=tmp_path / "run").report.to_json()
    assert report["first_operation"]["operation"].startswith("latent projection")
    (op,) = [d for d in report["diagnoses"] if d["kind"] == "operation_mismatch"]
    assert (op["tensor"], op["layer"], op["rounding"], op["confidence"]) == ("kv_latent", 0, "bfloat16", 1.0), op

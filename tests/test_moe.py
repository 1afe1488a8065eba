"""Mixture of experts (Qwen3-MoE, tiny-qwen3-moe): the engine, exact numerics, router probes, expert_flip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import kvdiff
from kvdiff.conversation import render_prompt_ids
from kvdiff.engine import Engine
from kvdiff.engine.numerics import exact_numerics
from kvdiff.engine.tiny import build_tiny_model
from kvdiff.errors import InputError, UnsupportedModelError
from kvdiff.options import Strategy
from kvdiff.probes.model_meta import model_dims
from kvdiff.probes.selection import Selection
from kvdiff.run.record import record
from kvdiff.trace import open_trace
from kvdiff.trace.format import DENSE_EXPERT
from kvdiff.trace.points import ALL_POINTS, MOE_POINTS

from conftest import (SEED_MESSAGES, SHARING_SYSTEM, assert_every_strategy_runs, assert_isolated_local_is_a_position_mismatch,
                      assert_router_points_are_the_models,
                      assert_prefix_exact_rows_are_the_forwards, moved_router_flip, planted_flip, prefix_exact_run)

MESSAGES = SEED_MESSAGES
OTHER = SHARING_SYSTEM


@pytest.fixture(scope="module")
def moe():
    return kvdiff.load_model("tiny-qwen3-moe")


def test_the_tiny_model_routes_every_layer_and_declares_the_router_points(moe):
    model, _ = moe
    dims = model_dims(model)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert (dims.num_experts, dims.experts_per_token) == (8, 2)
    assert set(dims.points()) == set(ALL_POINTS + MOE_POINTS)
    assert dims.point_shape("router_logits") == (8,)
    assert dims.point_shape("experts") == (2,)


def test_a_dense_model_declares_no_router_point(tiny_llama, tmp_path):
    model, tok = tiny_llama
    dims = model_dims(model)
    assert (dims.num_experts, dims.experts_per_token) == (0, 0) and dims.points() == ALL_POINTS
    with pytest.raises(InputError, match="mixture-of-experts"):
        Selection.parse(dims.num_layers, capture="experts", available=dims.points())
    with open_trace(record(model, tok, MESSAGES, tmp_path / "t.h5", max_new_tokens=2)) as tr:
        assert tr.meta.points == ALL_POINTS and tr.meta.dims.num_experts == 0


@pytest.mark.parametrize("numerics", ["fast", "exact"])
@pytest.mark.parametrize("strategy", [s.value for s in Strategy])
def test_every_strategy_runs(moe, strategy, numerics):
    assert_every_strategy_runs(*moe, strategy, numerics, MESSAGES, OTHER)


def test_reference_probes_hold_the_routers_logits_and_choices(moe, tmp_path):
    model, tok = moe
    path = assert_router_points_are_the_models(model, tok, MESSAGES, tmp_path)    # its choice: the top k of the softmax
    with open_trace(path) as tr:
        assert tr.meta.points == model_dims(model).points() and tr.meta.dims.num_experts == 8


def test_prefix_exact_is_bitwise_the_reference_with_a_cached_system_prompt(moe, tmp_path):
    assert_prefix_exact_rows_are_the_forwards(*moe, "tiny-qwen3-moe", MESSAGES, OTHER, tmp_path)


def test_exact_numerics_make_the_experts_row_invariant(moe):
    model, _ = moe
    block = model.model.layers[1].mlp
    rows = torch.randn(37, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with exact_numerics(model), torch.no_grad():
        whole = block(rows.unsqueeze(0))[0]
        parts = torch.cat([block(rows[a:b].unsqueeze(0))[0] for a, b in ((0, 1), (1, 20), (20, 37))])
        logits = block.gate(rows)[0]
        one_by_one = torch.cat([block.gate(rows[i:i + 1])[0] for i in range(37)])
    assert torch.equal(whole, parts) and torch.equal(logits, one_by_one)


def test_isolated_local_is_a_position_mismatch(tmp_path, moe):
    report = assert_isolated_local_is_a_position_mismatch(*moe, "tiny-qwen3-moe", MESSAGES, tmp_path)
    flips = [d for d in report["diagnoses"] if d["kind"] == "expert_flip"]
    assert all(d["cause"] == "upstream" for d in flips)      # a consequence, named as one


def _flip(moe, tmp_path, ref_offset: float, cand_offset: float, layer=1, position=20):
    model, tok = moe
    report, ref_experts, logits = planted_flip(model, tok, MESSAGES, tmp_path, ref_offset, cand_offset, layer, position)
    return report, ref_experts, logits, tok


def test_a_router_boosting_one_expert_at_one_token_is_named_expert_flip(moe, tmp_path):
    layer, position = 1, 20
    report, ref_experts, logits, tok = _flip(moe, tmp_path, None, 1.0, layer, position)
    flips = [d for d in report["diagnoses"] if d["kind"] == "expert_flip"]
    assert len(flips) == 1
    d = flips[0]
    ranked = np.argsort(-logits)
    assert (d["layer"], d["positions"], d["cause"]) == (layer, [position, position], "router")
    assert d["reference_experts"] == ref_experts == ranked[:2].tolist()
    assert d["candidate_experts"] == [int(ranked[2]), int(ranked[0])]   # 1.0 above the 2nd: above the 1st too
    assert d["router_margin"] == pytest.approx(float(logits[ranked[1]] - logits[ranked[2]]), rel=1e-6)
    assert d["router_logit_change"] == pytest.approx(float(logits[ranked[1]] - logits[ranked[2]]) + 1.0, rel=1e-5)
    ids = render_prompt_ids(tok, MESSAGES)
    assert d["token"] == tok.decode([ids[position]]) and d["confidence"] == 1.0
    assert report["first_divergence"]["tensor"] == "router_logits" and report["first_divergence"]["layer"] == layer


def test_a_near_tie_split_by_noise_is_named_a_near_tie(moe, tmp_path):
    # The reference's experts ranked 2 and 3 lie 1e-6 apart; the candidate's the other way round.
    report, _, logits, _ = _flip(moe, tmp_path, -1e-6, 1e-6)
    (d,) = [d for d in report["diagnoses"] if d["kind"] == "expert_flip"]
    assert (d["layer"], d["positions"], d["cause"]) == (1, [20, 20], "near_tie")
    assert d["router_margin"] == pytest.approx(1e-6, rel=0.3) and d["router_logit_change"] < 1e-5
    assert "near tie" in d["evidence"]


def test_a_choice_that_does_not_follow_its_own_logits_is_named_selection(moe, tmp_path):
    # The candidate's router logits are the reference's, bit for bit; its top-k slice is off by one.
    report, ref_experts, logits, _ = _flip(moe, tmp_path, None, "choice")
    (d,) = [d for d in report["diagnoses"] if d["kind"] == "expert_flip"]
    ranked = np.argsort(-logits)
    assert (d["layer"], d["positions"], d["cause"], d["side"]) == (1, [20, 20], "selection", "candidate")
    assert d["router_logit_change"] == 0 and d["own_top_k"] == ref_experts == ranked[:2].tolist()
    assert sorted(d["candidate_experts"]) == sorted(ranked[1:3].tolist()) and d["confidence"] == 1.0
    assert "not the top 2 of its own router's logits" in d["evidence"]


def test_a_perturbed_router_weight_in_the_engine_flips_where_the_weights_say(moe, tmp_path):
    """The candidate is the engine (prefix, exact) on a copy of the model whose last router has one
    expert's weights moved; the first flip is where top-k of the moved logits first differs."""
    model, tok = moe
    layer, expert = model.config.num_hidden_layers - 1, 3
    report, flipped, moved = moved_router_flip(model, tok, MESSAGES, tmp_path, layer, expert)
    assert flipped.size                                       # the planted change flips some tokens
    (d,) = [d for d in report["diagnoses"] if d["kind"] == "expert_flip"]
    assert (d["layer"], d["positions"][0], d["cause"]) == (layer, int(flipped[0]), "router")
    assert d["candidate_experts"] == moved[flipped[0]].tolist() and expert in d["candidate_experts"] + d["reference_experts"]


def test_unsupported_architectures_name_the_supported_families(moe):
    _, tok = moe
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match="qwen3_moe") as err:
        Engine(gpt2, tok)
    assert "\n" not in str(err.value) and "llama" in str(err.value)


def test_a_model_mixing_dense_layers_in_records_no_router_at_them(tmp_path):
    """mlp_only_layers=[0]: layer 0 is a dense MLP. Both paths give its router points the rows of no
    router (logits 0, experts -1), bitwise alike, and the routed layers their router's."""
    model, tok = build_tiny_model("tiny-qwen3-moe", mlp_only_layers=[0])
    assert model_dims(model).num_experts == 8
    trace, output, _, _ = prefix_exact_run(model, tok, "tiny-qwen3-moe", MESSAGES, OTHER, tmp_path)
    with open_trace(trace) as tr:
        rows = np.searchsorted(tr.positions, np.arange(output.chunks[1].positions[0], len(output.prompt_ids)))
        assert (tr.point(0, "experts", rows) == DENSE_EXPERT).all() and not tr.point(0, "router_logits", rows).any()
        assert (tr.point(1, "experts", rows) >= 0).all() and tr.point(1, "router_logits", rows).any()


def test_one_experts_mixing_weight_changed_is_named_by_the_rows_that_chose_it(moe, tmp_path, monkeypatch):
    """Red-team round 7, t10b: at layer 1 the engine weighs expert 3 by 1.5 wherever a row chose it
    (router logits and choices right): the rows that broke are exactly those, which the recorded
    choices show. Before: "the operation itself differs, not at every position"."""
    from types import SimpleNamespace

    import kvdiff.engine.runner as runner

    experts = runner.ModelRunner._experts

    def heavier(i, layer, h, probes):
        if i != 1:
            return experts(i, layer, h, probes)
        mix = layer.experts
        weighed = lambda x, chosen, weights: mix(x, chosen, torch.where(chosen == 3, weights * 1.5, weights))
        return experts(i, SimpleNamespace(router=layer.router, experts=weighed, shared_experts=layer.shared_experts),
                       h, probes)

    monkeypatch.setattr(runner.ModelRunner, "_experts", staticmethod(heavier))
    report = kvdiff.compare(MESSAGES, model="tiny-qwen3-moe", strategy="none", max_new_tokens=4,
                            out=tmp_path / "run").report.to_json()
    (op,) = [d for d in report["diagnoses"] if d["kind"] == "operation_mismatch"]
    assert (op["operation"], op["layer"], op["routed_expert"]) == ("MLP", 1, {"expert": 3, "first_choice": False}), op
    assert op["confidence"] == 1.0 and "every broken row chose expert 3" in op["evidence"]

"""The engine against the reference on the default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvdiff.engine import Engine
from kvdiff.engine.numerics import exact_numerics
from kvdiff.engine.reference import reference_generate
from kvdiff.conversation import render_prompt_ids
from test_engine_units import ListSink

pytestmark = pytest.mark.real_model

FRENCH = "You are a helpful assistant. Always answer in French."
PLAIN = "You are a helpful assistant."
SEEDS = [{"role": "system", "content": FRENCH}, {"role": "user", "content": "What is the capital of France?"}]
LONG_SYSTEM = " ".join(f"Rule {i}: answer briefly and politely, citing facts." for i in range(90))
TURN1 = [{"role": "system", "content": PLAIN}, {"role": "user", "content": "What is the capital of France?"}]
TURN2 = TURN1 + [{"role": "assistant", "content": "The capital of France is Paris."},
                 {"role": "user", "content": "And of Italy?"}]


def _conv(system, user):
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


SUITE = [
    SEEDS,
    TURN1,
    TURN2,
    _conv(PLAIN, "Hi"),
    _conv(PLAIN, "?"),
    _conv(None, "Name a colour."),
    _conv(FRENCH, "How are you?"),
    _conv(PLAIN, "Count from 1 to 5."),
    _conv("", "What is 2+2?"),
    _conv("Be terse.", "Define gravity."),
    _conv(PLAIN, "Translate 'cat' to Spanish."),
    _conv(FRENCH, "What is the largest ocean?"),
    _conv(LONG_SYSTEM, "Say hello."),
    _conv(PLAIN, "List three fruits."),
    TURN2 + [{"role": "assistant", "content": "Rome."}, {"role": "user", "content": "Spain?"}],
    _conv("A", "B"),
    _conv(PLAIN, "Write a haiku about rain."),
    _conv(FRENCH, "Who wrote Hamlet?"),
    _conv(PLAIN, "What day comes after Monday?"),
    _conv(PLAIN, "Is the sun a star?"),
]
NEW = 6


@pytest.fixture(scope="module")
def refs(default_model):
    model, tok = default_model
    fast = [reference_generate(model, tok, c, NEW).token_ids for c in SUITE]
    with exact_numerics(model):
        exact = [reference_generate(model, tok, c, NEW).token_ids for c in SUITE]
    return {"fast": fast, "exact": exact}


@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_prefix_matches_reference_on_the_suite(default_model, refs, numerics):
    model, tok = default_model
    eng = Engine(model, tok, strategy="prefix", numerics=numerics)
    outs = eng.generate(SUITE[:8], max_new_tokens=NEW) + eng.generate(SUITE[8:], max_new_tokens=NEW)
    assert [o.token_ids for o in outs] == refs[numerics]
    assert outs[2].chunks[0].cache == "hit" and outs[2].chunks[1].cache == "hit"   # turn 2 reuses turn 1
    again = eng.generate([SEEDS], max_new_tokens=NEW)[0]
    assert again.token_ids == refs[numerics][0] and again.stats.prefilled_tokens == 1


@pytest.mark.parametrize("numerics", ["fast", "exact"])
@pytest.mark.parametrize("chunk_size", [1, 4, 16])
def test_fixed_chunk_sizes_match_reference(default_model, refs, numerics, chunk_size):
    model, tok = default_model
    eng = Engine(model, tok, strategy="prefix", numerics=numerics, chunk_size=chunk_size)
    outs = eng.generate([SEEDS, SUITE[3]], max_new_tokens=NEW)
    assert [o.token_ids for o in outs] == [refs[numerics][0], refs[numerics][3]]
    if chunk_size == 1:
        assert all(len(range(c.positions[0], c.positions[1] + 1)) == 1 for c in outs[0].chunks)


def test_exact_prefix_is_bitwise_identical(default_model):
    model, tok = default_model
    conv = _conv(LONG_SYSTEM, "Say hello.")
    eng = Engine(model, tok, strategy="prefix", numerics="exact")
    eng.generate([_conv(LONG_SYSTEM, "Hi")], max_new_tokens=1)
    sink = ListSink(points={"k", "v", "resid_post", "logits"})
    out = eng.generate([conv], max_new_tokens=3, sinks={0: sink})[0]
    assert out.chunks[0].cache == "hit" and out.chunks[0].positions[1] + 1 >= 1000
    ids = render_prompt_ids(tok, conv)
    with exact_numerics(model), torch.no_grad():
        cache = DynamicCache(config=model.config)
        ref = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, output_hidden_states=True)
    allpos = list(range(len(ids)))
    computed = list(range(out.chunks[1].positions[0], len(ids)))
    for layer in range(model.config.num_hidden_layers):
        assert torch.equal(sink.stacked("k", layer, allpos), cache.layers[layer].keys[0].transpose(0, 1))
        assert torch.equal(sink.stacked("v", layer, allpos), cache.layers[layer].values[0].transpose(0, 1))
    for layer in range(model.config.num_hidden_layers - 1):
        assert torch.equal(sink.stacked("resid_post", layer, computed), ref.hidden_states[layer + 1][0, computed])
    assert torch.equal(sink.stacked("logits", None, computed), ref.logits[0, computed])


def test_isolated_strategies_diverge_on_the_seed_prompt(default_model, refs):
    model, tok = default_model
    for strategy in ("isolated-local", "isolated-global"):
        out = Engine(model, tok, strategy=strategy).generate([SEEDS], max_new_tokens=NEW)[0]
        assert out.token_ids != refs["fast"][0], strategy


def test_two_requests_sharing_a_system_chunk_prefill_it_once(default_model, refs):
    model, tok = default_model
    eng = Engine(model, tok)
    outs = eng.generate([SEEDS, _conv(FRENCH, "How are you?")], max_new_tokens=NEW)
    assert [o.token_ids for o in outs] == [refs["fast"][0], refs["fast"][6]]
    system_tokens = outs[0].chunks[0].positions[1] + 1
    assert outs[0].chunks[0].cache == "miss" and outs[1].chunks[0].cache == "hit"
    assert outs[1].stats.reused_tokens == system_tokens
    assert eng.stats.stored_tokens == sum(o.stats.prompt_tokens for o in outs) - system_tokens

"""Shared fixtures: tiny models for unit tests, the real default model for a few tests.

After each test, freed memory goes back to the system: glibc keeps the heap pages of freed
tensors smaller than its (self-raising) mmap threshold, so one process running the whole suite
grew by 0.1-0.7 GB a real-model test (4 GB after a dozen of them and 5.3 GB after the vLLM and
llama.cpp files, where malloc_trim gives 1.1-1.9 GB back).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import pytest

import kvdiff
from kvdiff.run.model_cache import ModelKey

SEED_SYSTEM = "You are a helpful assistant. Always answer in French."
SEED_PROMPT = "What is the capital of France?"
SEED_MESSAGES = [{"role": "system", "content": SEED_SYSTEM}, {"role": "user", "content": SEED_PROMPT}]
SHARING_SYSTEM = [{"role": "system", "content": SEED_SYSTEM},       # another request with the seeds' system prompt
                  {"role": "user", "content": "La capitale de la France est Paris."}]
TRIM_ABOVE = 1 << 30        # resident bytes from which a test's freed heap is given back


def _libc_trim():
    """glibc's malloc_trim, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_trim()


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


@pytest.fixture(autouse=True)
def _give_back_freed_memory():
    yield
    if _MALLOC_TRIM is not None and _resident_bytes() > TRIM_ABOVE:
        _MALLOC_TRIM(0)


@pytest.fixture(scope="session")
def default_model():
    """The bundled SmolLM2-135M-Instruct (converted and cached on first use)."""
    return kvdiff.load_model("smollm2-135m")


@pytest.fixture(scope="session", params=["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"])
def tiny_model(request):
    """Each tiny test model family in turn."""
    return kvdiff.load_model(request.param)


@pytest.fixture(scope="session")
def tiny_llama():
    return kvdiff.load_model("tiny-llama")


def assert_every_strategy_runs(model, tokenizer, strategy: str, numerics: str, messages: list, other: list) -> None:
    """A family's engine test: `messages`, then `other` sharing its system chunk, 6 tokens each;
    strategies none and prefix give the reference path's tokens, every reusing one hits the chunk."""
    import torch

    from kvdiff.engine import Engine
    from kvdiff.engine.numerics import exact_numerics
    from kvdiff.engine.reference import reference_generate

    outs = Engine(model, tokenizer, strategy=strategy, numerics=numerics).generate([messages, other], max_new_tokens=6)
    assert all(len(o.token_ids) == 6 for o in outs)
    if strategy in ("none", "prefix"):
        with exact_numerics(model) if numerics == "exact" else torch.no_grad():
            assert outs[0].token_ids == reference_generate(model, tokenizer, messages, 6).token_ids
    if strategy != "none":
        assert outs[1].chunks[0].cache == "hit"


def _routing(router, logits):
    """(weights, ids) a router gives a row of `logits`: gpt-oss's softmax over the top k, else the
    top k of the softmax renormalised."""
    if type(router).__name__ == "GptOssTopKRouter":
        top, ids = logits.topk(router.top_k)
        return top.softmax(-1), ids
    top, ids = logits.softmax(-1).topk(router.top_k)
    return top / top.sum(-1, keepdim=True), ids


def _router(model, layer: int):
    """`layer`'s router: `mlp.gate`, gpt-oss's `mlp.router`."""
    mlp = model.model.layers[layer].mlp
    return mlp.gate if hasattr(mlp, "gate") else mlp.router


def assert_router_points_are_the_models(model, tok, messages: list, tmp_path):
    """A recording of `messages`: at every layer and prompt position its router_logits are the
    model's own (`output_router_logits`) and its experts (float32) the ids the model's router
    picks from them. Returns the trace's path."""
    import numpy as np
    import torch

    from kvdiff.conversation import render_prompt_ids
    from kvdiff.run.record import record
    from kvdiff.trace import open_trace

    path = record(model, tok, messages, tmp_path / "router.h5", max_new_tokens=3)
    ids = render_prompt_ids(tok, messages)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_router_logits=True)
    with open_trace(path) as tr:
        prompt = np.arange(len(ids))
        for layer in range(model.config.num_hidden_layers):
            logits = tr.point(layer, "router_logits", prompt)
            experts = tr.point(layer, "experts", prompt)
            assert np.array_equal(logits, out.router_logits[layer].numpy())
            assert experts.dtype == np.float32
            assert np.array_equal(experts, _routing(_router(model, layer), torch.from_numpy(logits))[1].numpy())
    return path


def plant_router_logit(model, layer: int, position: int, offset: float | None):
    """A hook on `layer`'s router (`mlp.gate`, gpt-oss's `mlp.router`): at `position` of a prefill,
    the logit ranked k+1 is set to the k-th's plus `offset` (> 0: it takes the k-th's place), and
    that row's choice recomputed; `offset` None: the logits kept, the experts ranked 2 to k+1 chosen
    (a top-k slice off by one)."""
    gate = _router(model, layer)
    k = gate.top_k

    def hook(module, args, output):
        logits, weights, chosen = output
        if logits.shape[0] <= position:
            return None
        logits, weights, chosen = logits.clone(), weights.clone(), chosen.clone()
        ranked = logits[position].argsort(descending=True)
        if offset is None:
            chosen[position] = ranked[1:k + 1]
            weights[position] = logits[position, ranked[1:k + 1]].softmax(-1)
            return logits, weights, chosen
        logits[position, ranked[k]] = logits[position, ranked[k - 1]] + offset
        weights[position], chosen[position] = _routing(module, logits[position])
        return logits, weights, chosen

    return gate.register_forward_hook(hook)


def planted_flip(model, tok, messages: list, tmp_path, ref_offset, cand_offset, layer: int, position: int):
    """Reference traces (exact) of `messages` with `plant_router_logit(offset)` in each (None: no
    plant; "choice": the choice slice off by one); their diff's report, the first trace's experts and
    router logits at (layer, position)."""
    from kvdiff.run.record import record
    from kvdiff.trace import open_trace

    paths = []
    for name, offset in (("ref", ref_offset), ("cand", cand_offset)):
        handle = None if offset is None else plant_router_logit(model, layer, position, None if offset == "choice" else offset)
        try:
            paths.append(record(model, tok, messages, tmp_path / f"{name}.h5", max_new_tokens=4, numerics="exact"))
        finally:
            if handle is not None:
                handle.remove()
    with open_trace(paths[0]) as tr:
        ref_experts = tr.point(layer, "experts", [position])[0].astype(int).tolist()
        logits = tr.point(layer, "router_logits", [position])[0]
    return kvdiff.diff(*paths, tokenizer=tok).to_json(), ref_experts, logits


def moved_router_flip(model, tok, messages: list, tmp_path, layer: int, expert: int):
    """The engine (prefix, exact) on a copy of `model` whose `layer` router (`mlp.gate`) has `expert`'s
    weights moved, diffed against the reference (exact). Returns the report, the prompt positions
    where the moved router, run on the reference's router inputs (mlp_norm), chooses another set of
    experts, and its choices there."""
    import copy

    import numpy as np
    import torch

    from kvdiff.engine import Engine
    from kvdiff.engine.numerics import exact_numerics
    from kvdiff.probes.recorder import TraceRecorder
    from kvdiff.run.record import record
    from kvdiff.trace import open_trace

    changed = copy.deepcopy(model)
    gate = changed.model.layers[layer].mlp.gate
    with torch.no_grad():
        gate.weight[expert] += 0.4 * torch.randn(gate.weight.shape[1], generator=torch.Generator().manual_seed(1))
    ref = record(model, tok, messages, tmp_path / "ref.h5", max_new_tokens=4, numerics="exact")
    recorder = TraceRecorder.for_model(changed, tok, messages, tmp_path / "cand.h5", strategy="prefix", numerics="exact")
    output = Engine(changed, tok, numerics="exact").generate([messages], max_new_tokens=4, sinks={0: recorder})[0]
    recorder.finish(output.token_ids, output.text, output.chunks)
    with open_trace(ref) as tr:
        prompt = np.arange(tr.meta.input_ids.size)
        h = torch.from_numpy(tr.point(layer, "mlp_norm", prompt))
        ref_sets = np.sort(tr.point(layer, "experts", prompt), axis=1)
    with exact_numerics(changed), torch.no_grad():
        moved = gate(h)[2]
    flipped = np.flatnonzero((np.sort(moved.numpy(), axis=1) != ref_sets).any(axis=1))
    return kvdiff.diff(ref, tmp_path / "cand.h5", tokenizer=tok).to_json(), flipped, moved


def prefix_exact_run(model, tok, name: str, messages: list, other: list, tmp_path, **forward):
    """A family's prefix-exact test: `compare` of `messages` (prefix, exact), warmed with `other` whose
    system chunk it then reads from the cache, must be bitwise the reference's. Returns the engine's
    trace of `messages` after `other` (path), its output, and transformers' forward of the prompt in
    exact numerics (with `forward`'s arguments and hidden states) with its cache, to hold the rows to."""
    import torch
    from transformers import DynamicCache

    from kvdiff.conversation import render_prompt_ids
    from kvdiff.engine import Engine
    from kvdiff.engine.numerics import exact_numerics
    from kvdiff.probes.recorder import TraceRecorder
    from kvdiff.run.compare import compare

    result = compare(messages, model=name, strategy="prefix", numerics="exact", warm=other, max_new_tokens=6,
                     out=tmp_path / "run", model_cache={ModelKey(name): (model, tok)})
    report = result.report.to_json()
    assert result.exit_code == 0 and report["first_bit_difference"] is None
    assert [c["cache"] for c in report["chunks"]] == ["hit", "miss", "miss"]
    eng = Engine(model, tok, numerics="exact")
    eng.generate([other], max_new_tokens=1)
    recorder = TraceRecorder.for_model(model, tok, messages, tmp_path / "c.h5", strategy="prefix", numerics="exact")
    output = eng.generate([messages], max_new_tokens=4, sinks={0: recorder})[0]
    recorder.finish(output.token_ids, output.text, output.chunks)
    cache = DynamicCache(config=model.config)
    with exact_numerics(model), torch.no_grad():
        ref = model(input_ids=torch.tensor([render_prompt_ids(tok, messages)]), past_key_values=cache,
                    output_hidden_states=True, **forward)
    return tmp_path / "c.h5", output, ref, cache


def assert_isolated_local_is_a_position_mismatch(model, tok, name: str, messages: list, tmp_path) -> dict:
    """A family's position test: `compare` of `messages` under isolated-local (exact) differs first at
    layer 0 where the user chunk starts, leads with position_mismatch and names the user chunk's
    offset (minus its start). Returns the report."""
    from kvdiff.run.compare import compare

    result = compare(messages, model=name, strategy="isolated-local", numerics="exact", max_new_tokens=6,
                     out=tmp_path / "run", model_cache={ModelKey(name): (model, tok)})
    report = result.report.to_json()
    user = next(c for c in report["chunks"] if c["name"] == "user")
    assert result.exit_code == 1
    assert (report["first_bit_difference"]["layer"], report["first_bit_difference"]["position"]) == (0, user["positions"][0])
    mismatch = [d for d in report["diagnoses"] if d["kind"] == "position_mismatch" and d["chunk"] == "user"]
    assert mismatch and mismatch[0]["offset"] == -user["positions"][0]
    assert report["diagnoses"][report["top_diagnosis"]]["kind"] == "position_mismatch"
    return report


def assert_isolated_global_is_missing_context(model, tok, name: str, messages: list, tmp_path, warm: bool) -> dict:
    """A family's context test: `compare` of `messages` under isolated-global (exact) names the user
    chunk missing_context of every position before it, and no position_mismatch of it; computed in the
    run (attn_out differs at layer 0, recomputed from q, k and v), or with `warm` read from the cache
    (its K/V differ from layer 1). Returns the report."""
    from kvdiff.run.compare import compare

    result = compare(messages, model=name, strategy="isolated-global", numerics="exact", warm=warm, max_new_tokens=6,
                     out=tmp_path / "run", model_cache={ModelKey(name): (model, tok)})
    report = result.report.to_json()
    user = next(c for c in report["chunks"] if c["name"] == "user")
    assert result.exit_code == 1 and user["cache"] == ("hit" if warm else "miss")
    assert report["diagnoses"][report["top_diagnosis"]]["kind"] == "missing_context"
    found = [d for d in report["diagnoses"] if d["kind"] == "missing_context" and d["chunk"] == "user"]
    assert len(found) == 1, report["diagnoses"]
    assert (found[0]["unattended"], found[0]["layer"], bool(found[0].get("cached"))) == \
        ([0, user["positions"][0] - 1], 1 if warm else 0, warm)
    assert found[0]["positions"] == user["positions"] and 0 < found[0]["reference_attention_mass"] <= 1
    assert not [d for d in report["diagnoses"] if d["kind"] == "position_mismatch" and d["chunk"] == "user"]
    return report


def assert_prefix_exact_rows_are_the_forwards(model, tok, name: str, messages: list, other: list, tmp_path) -> None:
    """`prefix_exact_run` of a mixture of experts: at the positions the engine computed (after the
    cached system chunk), its router logits, layer inputs and logits are transformers' forward's bits."""
    import numpy as np

    from kvdiff.trace import open_trace

    trace, output, ref, _ = prefix_exact_run(model, tok, name, messages, other, tmp_path, output_router_logits=True)
    computed = np.arange(output.chunks[1].positions[0], len(output.prompt_ids))
    with open_trace(trace) as tr:
        rows = np.searchsorted(tr.positions, computed)
        for layer in range(model.config.num_hidden_layers):
            for point, want in (("router_logits", ref.router_logits[layer][computed]),
                                ("resid_pre", ref.hidden_states[layer][0, computed])):
                assert np.array_equal(tr.point(layer, point, rows), want.numpy())
        assert np.array_equal(tr.point(None, "logits", rows), ref.logits[0, computed].numpy())


def assert_reference_is_transformers_generation(model, tok, messages: list, new_tokens: int, numerics: str) -> None:
    """transformers' generate keeps only a sliding window's keys in those layers' cache; the reference
    path keeps every key and masks: the same greedy tokens, and (exact numerics too) its prefill's
    logits within float tolerance of a plain forward's."""
    import torch
    from transformers import DynamicCache

    from kvdiff.conversation import render_prompt_ids
    from kvdiff.engine.numerics import exact_numerics
    from kvdiff.engine.reference import reference_generate

    ids = render_prompt_ids(tok, messages)
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)[0, len(ids):].tolist()
        plain = model(input_ids=torch.tensor([ids])).logits[0]
    with exact_numerics(model) if numerics == "exact" else torch.no_grad():
        got = reference_generate(model, tok, messages, new_tokens).token_ids
        logits = model(input_ids=torch.tensor([ids]), past_key_values=DynamicCache()).logits[0]
    assert got == want[:len(got)] and len(got) == new_tokens
    assert torch.allclose(logits, plain, atol=1e-4)


def vllm_tiny_llama(out, default_model, **config):
    """A random Llama checkpoint in `out` that vLLM's CPU build runs (head_dim 64, 2 layers, one KV
    head) with the default model's vocabulary and tokenizer; `config` overrides its config."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model, tokenizer = default_model
    c = model.config
    settings = dict(vocab_size=c.vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
                    rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=True, bos_token_id=c.bos_token_id,
                    eos_token_id=c.eos_token_id)     # no pad id: its embedding row would be zeros
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**settings, **config})).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


class LentTarget:
    """A test module's engine under test lent to one `compare --engine` run, which closes the target
    it opens: this one stays open for the module's other tests."""

    def __init__(self, target):
        self._target = target

    def __getattr__(self, name):
        return getattr(self._target, name)

    def close(self):
        pass


def lent_open_target(target, weights: str = "float32"):
    """A stand-in for `open_target` that lends `target` to one `compare --engine` run, and checks that
    the run asked for the weights it runs."""
    def open_target(name, model, tokenizer, asked, options=None):
        assert str(asked) == weights, f"the run asked for {asked} weights, the lent engine runs {weights}"
        assert not options, f"the run asked for engine options {options}: a lent engine runs as it was started"
        return LentTarget(target)
    return open_target

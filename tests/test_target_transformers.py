"""The transformers continuous-batching target: real generate_batch runs on the tiny Llama.

Cold and warm runs agree, its traces match kvdiff's reference path, and bugs planted through
transformers' own extension points (a rotary-embedding hook, the paged cache's memory) are
caught by `kvdiff.diff(cold, warm)` with the diagnosis written down below before any run.
"""

from __future__ import annotations

import pytest
import torch

import kvdiff
from kvdiff.conversation import render_prompt_ids
from kvdiff.errors import InputError, KvdiffError, UnsupportedModelError
from kvdiff.probes.recorder import TraceRecorder
from kvdiff.targets.transformers_cb import TransformersTarget
from kvdiff.trace import open_trace

BLOCK = 4
NEW_TOKENS = 6
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Always answer in French."}
# TARGET is traced; OTHER shares its system prompt and fills the prefix cache first.
TARGET = [SYSTEM, {"role": "user", "content": "Rotary position embeddings rotate queries and keys."}]
OTHER = [SYSTEM, {"role": "user", "content": "What is the capital of France?"}]

# Written before the first run: what kvdiff.diff(cold, warm) must diagnose for each planted bug.
EXPECTED = {
    "rope_shift": "position_mismatch",          # cached keys were rotated at position + 3
    "stale_block": "cache_content_mismatch",    # a cached block holds another block's K/V
    "zeroed_row": "cache_content_mismatch",     # one cached position's K/V were zeroed
    "suffix_shift": "position_mismatch",        # the warm request computed its rows at position + 3
    "k_scaled": "cache_content_mismatch",       # cached keys computed by another k projection, V right
}
SHIFT = 3


@pytest.fixture(scope="module")
def target(tiny_llama):
    model, tokenizer = tiny_llama
    t = TransformersTarget(model, tokenizer, block_size=BLOCK, num_blocks=64)
    yield t
    t.close()


def _ids(target, messages):
    return render_prompt_ids(target.tokenizer, messages)


def _trace(target, path, messages):
    """A trace of one request recorded from the engine's own tensors."""
    ids = _ids(target, messages)
    recorder = TraceRecorder.for_model(target.model, target.tokenizer, messages, path, input_ids=ids,
                                       capture=target.points, max_new_tokens=NEW_TOKENS, strategy="transformers-cb")
    run = target.generate(ids, NEW_TOKENS, recorder)
    return recorder.finish(run.token_ids, run.text), run


def _shared_blocks(target):
    """Tokens of TARGET the engine can share after OTHER ran: whole blocks of the common prefix."""
    a, b = _ids(target, TARGET), _ids(target, OTHER)
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return min(common, len(a) - 1) // BLOCK * BLOCK


def test_cold_runs_repeat_and_warm_run_reuses_prefix(target):
    ids = _ids(target, TARGET)
    target.reset_cache()
    first = target.generate(ids, NEW_TOKENS)
    target.reset_cache()
    again = target.generate(ids, NEW_TOKENS)
    assert again.token_ids == first.token_ids and len(first.token_ids) == NEW_TOKENS
    assert first.cache_hit_tokens == again.cache_hit_tokens == 0
    assert len(first.margins) == NEW_TOKENS

    target.reset_cache()
    assert target.generate(_ids(target, OTHER), NEW_TOKENS).cache_hit_tokens == 0
    warm = target.generate(ids, NEW_TOKENS)
    assert warm.token_ids == first.token_ids
    assert warm.cache_hit_tokens == _shared_blocks(target) >= 2 * BLOCK


def test_traces_match_the_reference_path(target, tmp_path):
    model, tokenizer = target.model, target.tokenizer
    ref = kvdiff.record(model, tokenizer, TARGET, tmp_path / "ref.h5", max_new_tokens=NEW_TOKENS,
                        capture=target.points)
    target.reset_cache()
    cold, _ = _trace(target, tmp_path / "cold.h5", TARGET)
    target.reset_cache()
    target.generate(_ids(target, OTHER), NEW_TOKENS)
    warm, run = _trace(target, tmp_path / "warm.h5", TARGET)
    assert run.cache_hit_tokens > 0
    for cand in (cold, warm):
        div = kvdiff.diff(ref, cand, tokenizer=tokenizer)
        assert div.tokens_identical and div.first_divergence is None
        assert {d.kind for d in div.diagnoses} <= {"numerical_noise"}
    with open_trace(warm) as trace:
        assert trace.meta.kv_only_positions.tolist() == list(range(run.cache_hit_tokens))


def _rope_shift(target, phase):
    """While OTHER fills the cache, a rotary hook shifts its positions: cached keys encode p + SHIFT."""
    return _shift_positions(target) if phase == "fill" else None


def _suffix_shift(target, phase):
    """While TARGET runs warm, a rotary hook shifts the positions it computes after the cached prefix."""
    return _shift_positions(target) if phase == "warm" else None


def _shift_positions(target):
    def hook(module, args, kwargs):
        if "position_ids" in kwargs:
            return args, {**kwargs, "position_ids": kwargs["position_ids"] + SHIFT}
        return (args[0], args[1] + SHIFT, *args[2:]), kwargs

    return target.model.model.rotary_emb.register_forward_pre_hook(hook, with_kwargs=True)


def _stale_block(target, phase):
    """After OTHER ran: its second cached block is overwritten with its first (every layer)."""
    if phase == "filled":
        blocks = target.prefix_blocks(_ids(target, TARGET))
        for layer in range(target.model.config.num_hidden_layers):
            for dst, src in zip(target.block_kv(layer, blocks[1]), target.block_kv(layer, blocks[0])):
                dst.copy_(src)


def _zeroed_row(target, phase):
    """After OTHER ran: K and V of position BLOCK + 1 in the cache are zeroed (every layer)."""
    if phase == "filled":
        blocks = target.prefix_blocks(_ids(target, TARGET))
        for layer in range(target.model.config.num_hidden_layers):
            for rows in target.block_kv(layer, blocks[1]):
                rows[1].zero_()


def _k_scaled(target, phase):
    """While OTHER fills the cache, layer 0's k projection gives 1.05x its keys (V right)."""
    if phase == "fill":
        k_proj = target.model.model.layers[0].self_attn.k_proj
        return k_proj.register_forward_hook(lambda module, args, out: out * 1.05)
    return None


BUGS = {"rope_shift": _rope_shift, "suffix_shift": _suffix_shift, "stale_block": _stale_block,
        "zeroed_row": _zeroed_row, "k_scaled": _k_scaled}
# The positions the diagnosis must name, given the cache hit and the prompt length.
WHERE = {"rope_shift": lambda hit, n: (0, hit - 1), "suffix_shift": lambda hit, n: (hit, n - 1),
         "stale_block": lambda hit, n: (BLOCK, 2 * BLOCK - 1), "zeroed_row": lambda hit, n: (BLOCK + 1, BLOCK + 1),
         "k_scaled": lambda hit, n: (0, hit - 1)}


@pytest.mark.parametrize("bug", list(BUGS))
def test_planted_bug_is_diagnosed(target, tmp_path, bug):
    plant = BUGS[bug]
    target.reset_cache()
    cold, _ = _trace(target, tmp_path / "cold.h5", TARGET)
    target.reset_cache()
    handle = plant(target, "fill")
    try:
        target.generate(_ids(target, OTHER), NEW_TOKENS)
    finally:
        if handle is not None:
            handle.remove()
    with torch.no_grad():
        plant(target, "filled")
    handle = plant(target, "warm")
    try:
        warm, run = _trace(target, tmp_path / "warm.h5", TARGET)
    finally:
        if handle is not None:
            handle.remove()
    hit = _shared_blocks(target)
    assert run.cache_hit_tokens == hit

    div = kvdiff.diff(cold, warm, tokenizer=target.tokenizer)
    assert div.first_divergence is not None
    found = [d for d in div.diagnoses if d.kind == EXPECTED[bug]]
    assert found, f"expected {EXPECTED[bug]}, kvdiff said {[(d.kind, d.positions) for d in div.diagnoses]}"
    assert found[0].positions == WHERE[bug](hit, len(_ids(target, TARGET)))
    if bug.endswith("shift"):
        assert found[0].details["offset"] == SHIFT
    if bug == "stale_block":
        assert found[0].details["source_positions"] == list(range(BLOCK))
    if bug == "k_scaled":       # the keys are the reference's rotated right and scaled: the factor is named
        assert found[0].details["points"] == ["k"] and abs(found[0].details["k_scale"] - 1.05) < 1e-4


def test_requests_packed_in_one_forward_match_the_reference(target, tmp_path):
    """Two requests in one generate_batch call share forwards; each one's trace is its own."""
    sequences = []
    handle = target.model.register_forward_pre_hook(
        lambda m, a, kw: sequences.append(kw["cu_seq_lens_q"].numel() - 1), with_kwargs=True)
    target.reset_cache()
    recorders = []
    for name, messages in (("target", TARGET), ("other", OTHER)):
        recorders.append(TraceRecorder.for_model(target.model, target.tokenizer, messages, tmp_path / f"{name}.h5",
                                                 input_ids=_ids(target, messages), capture=target.points,
                                                 max_new_tokens=NEW_TOKENS, strategy="transformers-cb"))
    try:
        runs = target.generate_many([_ids(target, TARGET), _ids(target, OTHER)], NEW_TOKENS, recorders)
    finally:
        handle.remove()
    assert max(sequences) == 2
    for (name, messages), recorder, run in zip((("target", TARGET), ("other", OTHER)), recorders, runs):
        cand = recorder.finish(run.token_ids, run.text)
        ref = kvdiff.record(target.model, target.tokenizer, messages, tmp_path / f"{name}-ref.h5",
                            max_new_tokens=NEW_TOKENS, capture=target.points)
        div = kvdiff.diff(ref, cand)
        assert div.tokens_identical and div.first_divergence is None
        assert {d.kind for d in div.diagnoses} <= {"numerical_noise"}


def test_engine_failure_is_a_kvdiff_error_and_the_next_run_is_cold(target):
    ids = _ids(target, TARGET)
    target.reset_cache()
    expected = target.generate(ids, NEW_TOKENS).token_ids

    def fail(module, args, output):
        raise RuntimeError("planted failure")

    handle = target.model.model.layers[1].register_forward_hook(fail)
    try:
        with pytest.raises(KvdiffError, match="transformers continuous batching failed: .*planted failure"):
            target.generate(ids, NEW_TOKENS)
    finally:
        handle.remove()
    again = target.generate(ids, NEW_TOKENS)
    assert again.token_ids == expected and again.cache_hit_tokens == 0


def test_checkpoint_folder(tiny_llama, tmp_path):
    import transformers

    model, tokenizer = tiny_llama
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    t = TransformersTarget(tmp_path, block_size=BLOCK, num_blocks=16)
    try:
        assert t.info.name == "transformers" and t.info.checkpoint == tmp_path
        assert t.info.version == transformers.__version__
        ids = render_prompt_ids(tokenizer, TARGET)
        reference = kvdiff.record(model, tokenizer, TARGET, tmp_path / "ref.h5", max_new_tokens=NEW_TOKENS)
        with open_trace(reference) as trace:
            assert t.generate(ids, NEW_TOKENS).token_ids == trace.meta.generated_ids.tolist()
    finally:
        t.close()


def test_unsupported_point_is_refused(target, tmp_path):
    recorder = TraceRecorder.for_model(target.model, target.tokenizer, TARGET, tmp_path / "t.h5",
                                       input_ids=_ids(target, TARGET), capture="k,logits")
    with pytest.raises(InputError, match="cannot record logits"):
        target.generate(_ids(target, TARGET), NEW_TOKENS, recorder)
    recorder.abort()


def test_a_mixture_of_experts_records_its_router_and_a_wrong_selection_is_named(tmp_path):
    # Written before the first run: the router's points are recorded as the reference path records
    # them (cold and reference agree), and a warm run whose every router takes the experts ranked 2
    # to k+1 (a top-k slice off by one) is an expert_flip at layer 0, the first computed position,
    # cause "selection" of the candidate.
    model, tokenizer = kvdiff.load_model("tiny-qwen3-moe")
    t = TransformersTarget(model, tokenizer, block_size=BLOCK, num_blocks=64)
    try:
        assert {"router_logits", "experts"} <= set(t.points)
        ref = kvdiff.record(model, tokenizer, TARGET, tmp_path / "ref.h5", max_new_tokens=NEW_TOKENS, capture=t.points)
        cold, _ = _trace(t, tmp_path / "cold.h5", TARGET)
        div = kvdiff.diff(ref, cold, tokenizer=tokenizer)
        assert div.tokens_identical and div.first_divergence is None

        def off_by_one(module, args, output):
            logits, _, chosen = output
            ranked = logits.topk(chosen.shape[-1] + 1).indices[:, 1:]
            return logits, torch.gather(logits, 1, ranked).softmax(-1), ranked

        t.generate(_ids(t, OTHER), NEW_TOKENS)
        handles = [layer.mlp.gate.register_forward_hook(off_by_one) for layer in model.model.layers]
        try:
            warm, run = _trace(t, tmp_path / "warm.h5", TARGET)
        finally:
            for handle in handles:
                handle.remove()
    finally:
        t.close()
    flips = [d for d in kvdiff.diff(cold, warm, tokenizer=tokenizer).diagnoses if d.kind == "expert_flip"]
    assert run.cache_hit_tokens > 0 and len(flips) == 1
    d = flips[0]
    assert (d.details["layer"], d.positions[0], d.details["cause"], d.details["side"]) == \
        (0, run.cache_hit_tokens, "selection", "candidate")


def test_a_model_it_cannot_trace_or_share_is_said_so():
    with pytest.raises(UnsupportedModelError, match="latent attention"):
        TransformersTarget(*kvdiff.load_model("tiny-deepseek-v3"))
    t = TransformersTarget(*kvdiff.load_model("tiny-gemma3"), block_size=BLOCK, num_blocks=64)
    try:        # sliding-window layers: the engine never shares a prefix, so a warm run tests nothing
        assert "sliding-window" in t.info.no_reuse and {"attn_post_norm", "mlp_post_norm"} <= set(t.points)
    finally:
        t.close()

"""The vLLM target (kvdiff.targets.vllm) on a tiny random Llama, with real vLLM CPU runs in float32.

One engine for the module (reset_cache between tests). Planted bugs hook vLLM's own modules or
write its paged cache between a priming request and the warm request that reads the primed blocks.
Expectations of the planted-bug tests were written down before they were first run.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

import kvdiff  # noqa: E402
from kvdiff.conversation import render_prompt_ids  # noqa: E402
from kvdiff.errors import InputError, KvdiffError  # noqa: E402
from kvdiff.probes.recorder import TraceRecorder  # noqa: E402
from kvdiff.trace import open_trace  # noqa: E402
from conftest import lent_open_target, vllm_tiny_llama  # noqa: E402

pytestmark = pytest.mark.real_model

SYSTEM = ("You are a careful assistant. Answer briefly and precisely. When you are unsure, say so, and never "
          "invent facts. Prefer plain words over jargon, keep every answer short, and always name your sources "
          "when you can. Never repeat the question back, and do not apologise for things you did not do.")
PROMPT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]
PRIMER = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]
NEW = 6            # generated tokens per run
BLOCK = 32


@pytest.fixture(scope="module")
def folder(tmp_path_factory, default_model):
    """A random Llama checkpoint (head_dim 64, 2 layers) with the default model's vocabulary and tokenizer."""
    return vllm_tiny_llama(tmp_path_factory.mktemp("vllm-tiny-llama"), default_model)


@pytest.fixture(scope="module")
def hf(folder):
    return kvdiff.load_model(str(folder))


@pytest.fixture(scope="module")
def target(folder):
    from kvdiff.targets.vllm import VllmTarget

    t = VllmTarget(folder, block_size=BLOCK, kv_cache_bytes=64 * 2**20, max_model_len=512)
    yield t
    t.close()


@pytest.fixture(scope="module")
def ids(hf):
    _, tokenizer = hf
    prompt, primer = render_prompt_ids(tokenizer, PROMPT), render_prompt_ids(tokenizer, PRIMER)
    shared = next(i for i, (a, b) in enumerate(zip(prompt, primer)) if a != b)
    assert len(prompt) >= 80 and shared >= 64
    return prompt, primer, BLOCK * (shared // BLOCK)      # the primer leaves full blocks only in the cache


def _record(target, hf, path, prompt_ids, **kw):
    model, tokenizer = hf
    recorder = TraceRecorder.for_model(model, tokenizer, PROMPT, path, input_ids=prompt_ids, capture=target.points,
                                       strategy="vllm", max_new_tokens=NEW)
    run = target.generate(prompt_ids, NEW, sink=recorder)
    return recorder.finish(run.token_ids, run.text), run


@pytest.fixture(scope="module")
def cold_trace(target, hf, ids, tmp_path_factory):
    target.reset_cache()
    path, run = _record(target, hf, tmp_path_factory.mktemp("vllm-cold") / "cold.h5", ids[0])
    assert run.cache_hit_tokens == 0
    target.reset_cache()
    return path


def _primer_blocks(target, primer_ids) -> list[int]:
    """Run the primer (its prefix blocks stay cached) and return its block table, read in vLLM's forward context."""
    from vllm.forward_context import get_forward_context

    attn, table = target.model.model.layers[0].self_attn.attn, []

    def grab(module, args):
        if not table:
            table.extend(get_forward_context().attn_metadata[attn.layer_name].block_table[0].tolist())

    handle = attn.register_forward_pre_hook(grab)
    try:
        target.generate(primer_ids, 1)
    finally:
        handle.remove()
    return table


def _warm(target, hf, ids, path, plant_during_primer=None, plant_after_primer=None):
    """Reset, prime the shared prefix (optionally with a planted bug), then record the warm request."""
    target.reset_cache()
    handles = plant_during_primer(target) if plant_during_primer else []
    try:
        blocks = _primer_blocks(target, ids[1])
    finally:
        for h in handles:
            h.remove()
    if plant_after_primer:
        plant_after_primer(target, blocks)
    trace, run = _record(target, hf, path, ids[0])
    target.reset_cache()
    assert run.cache_hit_tokens == ids[2]
    return trace


def _cached_diagnoses(div, cached: int):
    return [d for d in div.diagnoses if d.positions and d.positions[1] < cached]


# -- clean runs ------------------------------------------------------------------------------------


def test_cold_reset_and_warm_runs(target, ids):
    prompt, primer, cached = ids
    target.reset_cache()
    first = target.generate(prompt, NEW)
    target.reset_cache()
    again = target.generate(prompt, NEW)
    assert first.token_ids == again.token_ids and len(first.token_ids) == NEW
    assert first.cache_hit_tokens == again.cache_hit_tokens == 0
    target.generate(primer, 1)
    warm = target.generate(prompt, NEW)
    assert warm.token_ids == first.token_ids
    assert warm.cache_hit_tokens == cached >= 32
    assert len(warm.margins) == NEW and all(m >= 0 for m in warm.margins)
    assert target.info.name == "vllm" and target.info.version
    target.reset_cache()


def test_trace_matches_transformers_reference(target, hf, ids, cold_trace, tmp_path):
    model, tokenizer = hf
    prompt, _, cached = ids
    ref = kvdiff.record(model, tokenizer, PROMPT, tmp_path / "ref.h5", max_new_tokens=NEW)
    warm = _warm(target, hf, ids, tmp_path / "warm.h5")
    with open_trace(cold_trace) as t:
        assert list(t.positions) == list(range(len(prompt) + NEW - 1))
        assert set(t.meta.points) == set(target.points) and t.meta.kv_only_positions.size == 0
        assert not t.provenance.reused.any()
        steps = t.steps
        assert steps.position.tolist() == list(range(len(prompt) - 1, len(prompt) + NEW - 1))
    with open_trace(warm) as t:
        assert t.meta.kv_only_positions.tolist() == list(range(cached))
        assert t.provenance.reused.tolist() == [True] * cached + [False] * (t.positions.size - cached)
        assert t.provenance.chunk[0] == "cache" and t.provenance.chunk[cached] == "prompt"
        assert t.provenance.encoded_position.tolist() == t.positions.tolist()
    margins = target.generate(prompt, NEW).margins
    np.testing.assert_allclose(margins, steps.margin, atol=1e-4)      # logprobs margins vs the logits rows
    for cand in (cold_trace, warm):
        div = kvdiff.diff(ref, cand)
        assert div.tokens_identical
        assert div.first_divergence is None, div.first_divergence
        assert {d.kind for d in div.diagnoses} <= {"numerical_noise"}
        df = div.to_pandas()
        rows = df[df.point.isin(["resid_pre", "k", "v"]) & df.max_abs.notna()]
        assert len(rows) and rows.max_abs.max() <= 1e-4


# -- planted bugs: diff(cold, warm) must name them -------------------------------------------------


def test_clean_warm_run_matches_cold(target, hf, ids, cold_trace, tmp_path):
    div = kvdiff.diff(cold_trace, _warm(target, hf, ids, tmp_path / "warm.h5"))
    assert div.tokens_identical and div.first_divergence is None and not div.diagnoses


def test_position_shift_of_cached_tokens(target, hf, ids, cold_trace, tmp_path):
    """The primer encodes the tokens that end up cached at positions +5: the warm run reads keys
    rotated to the wrong positions. Expected: position_mismatch over the cached positions
    (0..cached-1, chunk "cache"), offset +5, and no cache_content_mismatch (v is untouched)."""
    cached = ids[2]

    def shift(target):
        def hook(module, args):
            positions, *rest = args
            return (torch.where(positions < cached, positions + 5, positions), *rest)

        ropes = {id(l.self_attn.rotary_emb): l.self_attn.rotary_emb for l in target.model.model.layers}
        return [rope.register_forward_pre_hook(hook) for rope in ropes.values()]

    div = kvdiff.diff(cold_trace, _warm(target, hf, ids, tmp_path / "warm.h5", plant_during_primer=shift))
    found = _cached_diagnoses(div, cached)
    assert [d.kind for d in found] == ["position_mismatch"], div.diagnoses
    assert found[0].chunk == "cache" and found[0].positions == (0, cached - 1)
    assert found[0].details["offset"] == 5


def test_a_model_fed_wrong_positions_after_a_hit_is_a_position_mismatch(target, hf, ids, cold_trace, tmp_path,
                                                                          monkeypatch):
    """vLLM's model runner gives the rows after a cache hit positions from 0 (the query offset alone)
    while its slots and sequence lengths stay right (red-team v3). The target used to record the
    rows at the positions the model was given, and the run died ("vLLM sampled 8 tokens but the
    target saw 7 logits rows"). Expected (written before the fix's first run): the rows recorded at
    their places in the sequence, a position_mismatch from the first uncached position to the
    prompt's end, offset -cached, and the engine's encoded positions in provenance."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    prepare = GPUModelRunner._prepare_inputs

    def planted(self, scheduler_output, num_scheduled_tokens):
        out = prepare(self, scheduler_output, num_scheduled_tokens)
        start = 0
        for r, n in enumerate(int(n) for n in num_scheduled_tokens[:self.input_batch.num_reqs]):
            done = int(self.input_batch.num_computed_tokens_cpu[r])
            if n > 1 and done:
                self.positions[start:start + n] -= done
            start += n
        return out

    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", planted)
    cached, prompt = ids[2], len(ids[0])
    div = kvdiff.diff(cold_trace, _warm(target, hf, ids, tmp_path / "warm.h5"))
    shift = [d for d in div.diagnoses if d.kind == "position_mismatch"]
    assert [(d.positions, d.details["offset"]) for d in shift] == [((cached, prompt - 1), -cached)], div.diagnoses
    assert shift[0].details["provenance_encoded_positions"] == [0, prompt - 1 - cached]
    assert div.first_divergence.position == cached


def test_a_null_block_in_a_hit_table_without_a_window_is_read_as_cached_rows(target, hf, ids, cold_trace, tmp_path,
                                                                               monkeypatch):
    """The warm request's attention metadata names vLLM's null block in place of its first cached block
    (red-team v8). The target took the null block for a sliding window's gap, recorded nothing there and
    the report claimed attention's inputs matched. Expected (written before the fix's first run): those
    positions read as the zero rows the null block holds, a cache_content_mismatch naming them."""
    import dataclasses

    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

    build = CPUAttentionMetadataBuilder.build

    def planted(self, common_prefix_len, metadata, fast_build=False):
        query = int(metadata.query_start_loc_cpu[1] - metadata.query_start_loc_cpu[0])
        if metadata.num_reqs == 1 and query > 1 and int(metadata.seq_lens[0]) > query:    # the prefill after a hit
            table = metadata.block_table_tensor.clone()
            table[0, 0] = target.null_block
            metadata = dataclasses.replace(metadata, block_table_tensor=table)
        return build(self, common_prefix_len, metadata, fast_build)

    monkeypatch.setattr(CPUAttentionMetadataBuilder, "build", planted)
    div = kvdiff.diff(cold_trace, _warm(target, hf, ids, tmp_path / "warm.h5"))
    cache = [d for d in div.diagnoses if d.kind == "cache_content_mismatch"]
    assert [d.positions for d in cache] == [(0, BLOCK - 1)], div.diagnoses
    assert cache[0].details["zero_rows"] == ["k", "v"]


def test_stale_cached_block(target, hf, ids, cold_trace, tmp_path):
    """After the primer, the cache block of positions 32..63 is overwritten with the block of 0..31
    in every layer. Expected (written before the first run): cache_content_mismatch over 32..63
    (chunk "cache") whose layer-0 rows equal the reference's at positions p - 32.
    Found on the first run: where the token at p equals the token at p - 32 (the system prompt
    repeats words), the stale row is also that token's key rotated 32 positions back, and kvdiff
    then printed a position_mismatch of offset -32 beside the cache_content_mismatch over the same
    rows. Since diagnoses are checked against each other (issue #27), only the claim that explains
    every row stands: one cache_content_mismatch over 32..63."""
    prompt, _, cached = ids

    def stale(target, blocks):
        with torch.inference_mode():          # vLLM's cache is an inference tensor
            for layer in target.model.model.layers:
                kv = layer.self_attn.attn.kv_cache
                kv[blocks[1]] = kv[blocks[0]]

    div = kvdiff.diff(cold_trace, _warm(target, hf, ids, tmp_path / "warm.h5", plant_after_primer=stale))
    found = _cached_diagnoses(div, cached)
    assert [d.kind for d in found] == ["cache_content_mismatch"], div.diagnoses
    content = found[0]
    assert content.chunk == "cache" and content.positions == (32, 63)
    # each row is named by its source, p - 32, also where that token occurs more than once in 0..31
    # (its v rows are equal there; the k it holds was rotated at its source). Rows whose token is the
    # one 32 positions back hold the reference's v: `rows` leaves them out, and the sources follow it.
    rows = [p for first, last in content.details.get("rows", [[32, 63]]) for p in range(first, last + 1)]
    assert content.details["source_positions"] == [p - 32 for p in rows], str(content.details)


def test_dropped_cached_row(target, hf, ids, cold_trace, tmp_path):
    """After the primer, K and V of cached position 40 are zeroed in every layer (a row never written).
    Expected: cache_content_mismatch at exactly 40..40 (chunk "cache"), no source position (zeros
    match no reference row), and no other diagnosis over the cached positions."""
    from kvdiff.targets.vllm import cache_views

    def drop(target, blocks):
        with torch.inference_mode():
            for layer in target.model.model.layers:
                k_t, v = cache_views(layer.self_attn.attn)
                k_t[blocks[1], :, :, 40 - BLOCK] = 0
                v[blocks[1], :, 40 - BLOCK] = 0

    div = kvdiff.diff(cold_trace, _warm(target, hf, ids, tmp_path / "warm.h5", plant_after_primer=drop))
    found = _cached_diagnoses(div, ids[2])
    assert [d.kind for d in found] == ["cache_content_mismatch"], div.diagnoses
    assert found[0].chunk == "cache" and found[0].positions == (40, 40)
    assert found[0].details["source_positions"] == [None]


def _rope_base(target, base):
    ropes = {id(layer.self_attn.rotary_emb): layer.self_attn.rotary_emb for layer in target.model.model.layers}
    saved = [(rope, rope.cos_sin_cache) for rope in ropes.values()]
    for rope, old in saved:
        freqs = torch.outer(torch.arange(old.shape[0], dtype=torch.float), rope._compute_inv_freq(base))
        rope.cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(old.dtype)
    return lambda: [setattr(rope, "cos_sin_cache", old) for rope, old in saved]


def _set(objects, name, value):
    saved = [(o, getattr(o, name)) for o in objects]
    for o in objects:
        setattr(o, name, value(getattr(o, name)))
    return lambda: [setattr(o, name, old) for o, old in saved]


def _scaled_output(module, factor):
    handle = module.register_forward_hook(lambda m, a, out: (out[0] * factor, *out[1:]))   # (output, bias)
    return handle.remove


EVERY_RUN = {   # bug in every vLLM run: (plant, first operation, its layer, a diagnosis kind, a check of it)
    "rope base 20000 (10000 declared)": (
        lambda t: _rope_base(t, 20000.0), "RoPE (on q and k)", 0, "rope_mismatch",
        lambda d: abs(d["base"] / 2e4 - 1) < 1e-3 and abs(d["reference_base"] / 1e4 - 1) < 1e-3),
    "softmax scale x1.25": (
        lambda t: _set([layer.self_attn.attn.impl for layer in t.model.model.layers], "scale", lambda v: v * 1.25),
        "attention (softmax(q k^T) v)", 0, "attention_mismatch",
        lambda d: d["explanation"] == "scale" and abs(d["scale_factor"] - 1.25) < 1e-3),
    "layer 1 attention norm eps 1e-2": (
        lambda t: _set([t.model.model.layers[1].input_layernorm], "variance_epsilon", lambda v: 1e-2),
        "attention norm", 1, "norm_consistency", lambda d: d["candidate_inconsistent"]["layer"] == 1),
    "layer 0 down_proj x1.01": (
        lambda t: _scaled_output(t.model.model.layers[0].mlp.down_proj, 1.01), "MLP", 0, "operation_mismatch",
        lambda d: d["layer"] == 0),
}


@pytest.mark.parametrize("bug", list(EVERY_RUN))
def test_a_bug_in_every_run_is_diagnosed_against_the_reference(target, folder, hf, monkeypatch, tmp_path, bug):
    """A bug planted in every vLLM run: cold and warm agree, and `kvdiff compare --engine vllm` (digest
    mode) names it from the cold run against kvdiff's reference."""
    from kvdiff.run import engine_compare
    from kvdiff.run.compare import compare
    from kvdiff.run.model_cache import ModelKey

    plant, operation, layer, kind, check = EVERY_RUN[bug]
    monkeypatch.setattr(engine_compare, "open_target", lent_open_target(target))
    undo = plant(target)
    try:
        result = compare(PROMPT, engine="vllm", model=str(folder), warm=PRIMER, max_new_tokens=NEW,
                         out=tmp_path / "run", model_cache={ModelKey(str(folder)): hf})
    finally:
        undo()
        target.reset_cache()
    report = result.report.to_json()
    assert report["engine"]["cache_hit_tokens"] == report["engine"]["cached_positions_recorded"] > 0
    assert {d["kind"] for d in report["diagnoses"]} <= {"numerical_noise"}
    against = report["engine_vs_reference"]
    first = against["first_operation"]
    assert (first["operation"], first["layer"], first["tier"], first["proved"]) == (operation, layer, "divergent", True)
    found = [d for d in against["diagnoses"] if d["kind"] == kind]
    assert found and all(check(d) for d in found), against["diagnoses"]
    kinds = {d["kind"] for d in against["diagnoses"]}
    assert not kinds & {"position_mismatch", "missing_context", "cache_content_mismatch"}, kinds
    assert against["zoom"]["layers"] == [0, 1] and against["repeated"]


# -- errors ----------------------------------------------------------------------------------------


def test_vllm_failure_is_a_kvdiff_error_and_the_engine_survives(target, ids):
    def boom(module, args):
        raise RuntimeError("planted failure")

    handle = target.model.model.layers[1].mlp.register_forward_pre_hook(boom)
    try:
        with pytest.raises(KvdiffError, match="vLLM failed: .*planted failure") as info:
            target.generate(ids[0], 2)
        assert info.value.exit_code == 3
    finally:
        handle.remove()
    assert len(target.generate(ids[0], 2).token_ids) == 2
    target.reset_cache()


def test_an_engine_that_changes_the_prompt_it_was_given_is_refused_with_what_it_ran(target, ids, monkeypatch):
    """Red-team round 6, t26: vLLM handed a second BOS before the prompt ran one token more than it
    was sent, and the trace's own check then blamed kvdiff's writer."""
    generate = type(target.llm).generate

    def with_bos(self, prompts, *args, **kwargs):
        prompts = [dict(p, prompt_token_ids=[1] + list(p["prompt_token_ids"])) for p in prompts]
        return generate(self, prompts, *args, **kwargs)

    monkeypatch.setattr(type(target.llm), "generate", with_bos)
    n = len(ids[0])
    with pytest.raises(KvdiffError, match=rf"vLLM ran {n + 1} prompt tokens for the {n} kvdiff sent .*position 1: "
                                          rf"1 where {ids[0][1]} was sent\): the engine changed the prompt"):
        target.generate(ids[0], 2)
    monkeypatch.undo()
    target.reset_cache()


def test_unsupported_head_dim_is_refused_before_vllm_starts(tmp_path):
    from kvdiff.targets.vllm import VllmTarget

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                                                      "num_attention_heads": 4}))
    with pytest.raises(InputError, match="head_dim 16 .*head_dim must be one of 32, 64, 80"):
        VllmTarget(tmp_path)



def test_points_vllm_cannot_give_are_refused(target, hf, ids, tmp_path):
    model, tokenizer = hf
    recorder = TraceRecorder.for_model(model, tokenizer, PROMPT, tmp_path / "all.h5", input_ids=ids[0])
    try:
        with pytest.raises(InputError, match="cannot record logits"):
            target.generate(ids[0], 2, sink=recorder)
    finally:
        recorder.abort()

"""Unit tests of the engine's parts on the tiny models (fast)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

import kvdiff
from kvdiff.engine import Engine
from kvdiff.engine.partial_attention import merge_states, partial_attention
from kvdiff.engine.partial_attention import with_sinks as with_sinks_of
from kvdiff.engine.chunks import split_conversation
from kvdiff.engine.kv_cache import BlockPool, BlockTable, OutOfBlocks
from kvdiff.engine.cpu_linear import ROW_TILE as CPU_ROW_TILE
from kvdiff.engine.numerics import exact_attention, exact_numerics, invariant_linear
from kvdiff.engine.paged_decode import PagedDecode
from kvdiff.engine.reference import cache_keyword, reference_generate
from kvdiff.conversation import render_prompt_ids
from kvdiff.engine.registry import ChunkRegistry
from kvdiff.trace.fingerprint import model_fingerprint
from kvdiff.engine.strategies import select_blend_tokens
from kvdiff.options import Strategy
from kvdiff.engine.tiny import tiny_tokenizer
from kvdiff.errors import InputError, TokenizationBoundaryError, UnsupportedModelError
from kvdiff.trace.points import LAYER_POINTS

SYSTEM = "You are a helpful assistant. Always answer in French."
PROMPT = "What is the capital of France?"
SEED_MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]
OTHER = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "La capitale de la France est Paris."}]


class ListSink:
    """Records every call; rows by (point, layer) and position (a later capture wins)."""

    def __init__(self, points=None):
        self.points = points
        self.calls: list[tuple] = []
        self.rows: dict[tuple, dict[int, torch.Tensor]] = {}
        self.norms: list[tuple] = []
        self.provenances: list[tuple] = []
        self.steps: list[tuple] = []
        self.brackets: list[dict] = []
        self._open: dict | None = None

    def wants(self, point, layer):
        return self.points is None or point in self.points

    def begin_forward(self, positions, reads_only=False):
        assert self._open is None, "begin_forward inside an open forward"
        self._open = {"positions": list(positions), "fired": {}, "reads_only": reads_only}
        self.calls.append(("begin", list(positions)))

    def capture(self, point, layer, rows, positions):
        assert self._open is not None, "capture outside a forward"
        assert rows.shape[0] == len(positions)
        key = (point, layer)
        self._open["fired"][key] = self._open["fired"].get(key, 0) + 1
        store = self.rows.setdefault(key, {})
        for row, pos in zip(rows, positions):
            store[int(pos)] = row.detach().clone()

    def capture_norm(self, norm, layer, norm_input, norm_output, positions):
        assert self._open is not None
        self.norms.append((norm, layer, list(positions)))

    def provenance(self, positions, source):
        assert self._open is not None
        self.provenances.append((list(positions), source))

    def capture_step(self, step, position, logits_row, token_id):
        self.steps.append((step, position, int(logits_row.argmax()), token_id))

    def end_forward(self):
        assert self._open is not None
        self.brackets.append(self._open)
        self._open = None

    def stacked(self, point, layer, positions):
        return torch.stack([self.rows[(point, layer)][p] for p in positions])


def ref_tokens(model, tok, messages, n=8, exact=False):
    if exact:
        with exact_numerics(model):
            return reference_generate(model, tok, messages, n).token_ids
    return reference_generate(model, tok, messages, n).token_ids


# --- chunks ---------------------------------------------------------------------------------

def test_chunks_per_message_concatenate_to_the_prompt(tiny_llama):
    _, tok = tiny_llama
    msgs = SEED_MESSAGES + [{"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Why?"}]
    cp = split_conversation(tok, msgs)
    assert [c.name for c in cp.chunks] == ["system", "user", "assistant", "user#2", "generation"]
    assert cp.prompt_ids == render_prompt_ids(tok, msgs)
    assert [c.start for c in cp.chunks] == [0] + [c.end for c in cp.chunks[:-1]]


def test_prompt_ids_are_the_chat_templates_tokens_kept_per_text(tiny_llama):
    """render_prompt_ids gives apply_chat_template(tokenize=True)'s ids, tokenizing a conversation
    once (the engine's boundary check and the trace both ask), and a caller's list is its own."""
    _, tok = tiny_llama
    msgs = SEED_MESSAGES + [{"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Why?"}]
    expected = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    first = render_prompt_ids(tok, msgs)
    first.append(-1)
    calls = []
    tokenize = type(tok).__call__
    type(tok).__call__ = lambda self, *a, **k: calls.append(a) or tokenize(self, *a, **k)
    try:
        assert render_prompt_ids(tok, msgs) == expected and not calls
    finally:
        type(tok).__call__ = tokenize


def test_empty_message_gives_no_chunk_and_is_recorded(tiny_llama):
    _, tok = tiny_llama
    msgs = [{"role": "system", "content": ""}, {"role": "user", "content": PROMPT}]
    cp = split_conversation(tok, msgs)
    assert [c.name for c in cp.chunks] == ["user", "generation"]
    assert [(s.message_index, s.role) for s in cp.skipped] == [(0, "system")]


def test_fixed_chunks(tiny_llama):
    _, tok = tiny_llama
    cp = split_conversation(tok, SEED_MESSAGES, chunk_size=4)
    assert [c.name for c in cp.chunks][:2] == ["chunk0", "chunk1"]
    assert all(len(c.token_ids) == 4 for c in cp.chunks[:-1])
    assert cp.prompt_ids == render_prompt_ids(tok, SEED_MESSAGES)


def test_chunk_tokens_are_kept_per_text_until_the_vocabulary_changes():
    """A system prompt sent again is not tokenized again; tokens added to the tokenizer drop what was kept."""
    tok = tiny_tokenizer()
    first = split_conversation(tok, SEED_MESSAGES)
    again = split_conversation(tok, OTHER)
    assert again.chunks[0].token_ids is first.chunks[0].token_ids
    tok.add_tokens(["helpful"])
    after = split_conversation(tok, SEED_MESSAGES)
    assert after.prompt_ids == render_prompt_ids(tok, SEED_MESSAGES) != first.prompt_ids


def test_a_tokenizer_with_kept_tokens_can_still_be_freed():
    import gc
    import weakref

    tok = tiny_tokenizer()
    split_conversation(tok, SEED_MESSAGES)
    gone = weakref.ref(tok)
    del tok
    gc.collect()
    assert gone() is None       # its cache of token ids does not keep it alive


def test_boundary_merge_is_an_error_naming_the_position():
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    msgs = [{"role": "system", "content": "The capi"}, {"role": "user", "content": "tal of France"}]
    with pytest.raises(TokenizationBoundaryError, match="position"):
        split_conversation(tok, msgs)
    cp = split_conversation(tok, msgs, allow_boundary_mismatch=True)
    assert cp.boundary_mismatch and cp.prompt_ids == [t for c in cp.chunks for t in c.token_ids]


# --- registry ---------------------------------------------------------------------------------

def _pool(blocks=8):
    return BlockPool(2, 1, 4, blocks, torch.float32, torch.device("cpu"), block_size=4)


def test_registry_lru_evicts_only_unreferenced():
    pool = _pool(4)
    reg = ChunkRegistry(pool, bytes_per_block=100, budget_bytes=300)
    a = reg.insert(reg.key("fp", "prefix", [1]), [1], 0, 0)
    b = reg.insert(reg.key("fp", "prefix", [2]), [2], 0, 0)
    c = reg.insert(reg.key("fp", "prefix", [3]), [3], 0, 0)
    reg.acquire(a)
    assert reg.lookup(b.key, [2]) is b          # b is now more recent than c
    reg.insert(reg.key("fp", "prefix", [4]), [4], 0, 0)
    assert reg.has_key(a.key) and reg.has_key(b.key) and not reg.has_key(c.key)
    assert reg.stats.evictions == 1 and reg.stats.bytes == 300
    reg.release(a)
    with pytest.raises(ValueError):
        reg.release(a)


def test_registry_token_check_turns_collision_into_miss():
    reg = ChunkRegistry(_pool(), 100, 10_000, digest=lambda data: "0" * 64)
    key = reg.key("fp", "prefix", [1, 2])
    reg.insert(key, [1, 2], 0, 0)
    assert reg.key("fp", "prefix", [7]) == key
    assert reg.lookup(key, [7]) is None
    assert reg.stats.collisions == 1 and reg.lookup(key, [1, 2]) is not None


def test_forced_collision_never_returns_wrong_kv(tiny_llama):
    model, tok = tiny_llama
    eng = Engine(model, tok)
    eng.registry.digest = lambda data: "0" * 64
    outs = eng.generate([SEED_MESSAGES, OTHER], max_new_tokens=6)
    assert outs[0].token_ids == ref_tokens(model, tok, SEED_MESSAGES, 6)
    assert outs[1].token_ids == ref_tokens(model, tok, OTHER, 6)
    assert eng.stats.collisions > 0


def test_fingerprint_is_stable_and_weight_sensitive():
    m1, _ = kvdiff.load_model("tiny-llama")
    m2, _ = kvdiff.load_model("tiny-llama")
    assert model_fingerprint(m1) == model_fingerprint(m2)
    with torch.no_grad():
        m2.lm_head.weight[0, 0] += 1.0
    assert model_fingerprint(m1) != model_fingerprint(m2)


def test_tokenizer_fingerprint_is_remembered_and_follows_changes():
    """The fingerprint is computed once per tokenizer object, and again when the tokenizer is
    changed in place: tokens added, a new chat template, a new post-processor."""
    from tokenizers import processors

    from kvdiff.trace.fingerprint import tokenizer_fingerprint

    _, tok = kvdiff.load_model("tiny-llama")
    first = tokenizer_fingerprint(tok)
    assert tokenizer_fingerprint(tok) == first
    seen = {first}
    tok.add_tokens(["<kvdiff-added>"])
    seen.add(tokenizer_fingerprint(tok))
    tok.chat_template = "{{ messages[0]['content'] }}"
    seen.add(tokenizer_fingerprint(tok))
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    seen.add(tokenizer_fingerprint(tok))
    assert len(seen) == 4


def test_device_weight_digests_match_their_definition_across_chunks(monkeypatch):
    """The on-device hash (run here on CPU tensors) against numpy: words mixed with their index
    and summed modulo 2**64, whatever the chunking and word size."""
    from kvdiff.trace import fingerprint as model_meta

    def by_definition(tensor: torch.Tensor) -> bytes:
        words = tensor.contiguous().view(-1).view({2: torch.int16, 4: torch.int32}[tensor.element_size()])
        x = words.numpy().astype(np.int64) * model_meta._MUL1 + np.arange(words.numel()) * model_meta._MUL2
        x ^= x >> 31
        x *= model_meta._MUL3
        x ^= x >> 29
        return int(x.view(np.uint64).sum(dtype=np.uint64)).to_bytes(8, "little")

    monkeypatch.setattr(model_meta, "_HASH_CHUNK", 1000)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(37, 101, generator=gen).to(torch.bfloat16), torch.randn(4099, generator=gen),
               torch.randn(5, 3, generator=gen).to(torch.float16)]
    assert model_meta.gpu_weight_digests(tensors) == [by_definition(t) for t in tensors]
    assert model_meta.gpu_weight_digests([]) == []


# --- paged KV cache -----------------------------------------------------------------------------

def test_a_cache_hits_block_table_is_known_on_the_host(monkeypatch):
    """A shared entry's host slots come with it: the table's slots, and a position's, need no device read."""
    pool = _pool(8)
    blocks = pool.allocate(2)
    table = BlockTable(pool)
    table.add_shared("k", pool.slots(blocks, 5), pool.host_slots(blocks, 5))
    table.add_own(3)
    expected = table.all_slots().tolist()
    monkeypatch.setattr(BlockTable, "all_slots", lambda self: pytest.fail("the slots were read from the device"))
    assert table.host_slots().tolist() == expected and table.slot_of(6) == expected[6]


def test_block_table_maps_positions_across_unaligned_segments():
    pool = _pool(8)
    table = BlockTable(pool)
    shared = pool.slots(pool.allocate(2), 5)
    table.add_shared("k", shared)
    table.add_own(3)
    table.add_own(2)
    assert table.length == 10
    assert table.slot_of(4) == int(shared[4])
    assert len(set(table.all_slots().tolist())) == 10
    assert table.host_slots().tolist() == table.all_slots().tolist()
    for _ in range(3):       # decode steps extend the host copy in place of re-reading the device
        table.add_own(1)
        assert table.host_slots().tolist() == table.all_slots().tolist()
    table.release()
    assert pool.free_blocks == 6 and table.host_slots().size == 0
    with pytest.raises(OutOfBlocks):
        pool.allocate(7)


def test_fully_cached_prompt_still_computes_one_token(tiny_llama):
    model, tok = tiny_llama
    eng = Engine(model, tok)
    first = eng.generate([SEED_MESSAGES], max_new_tokens=6)[0]
    again = eng.generate([SEED_MESSAGES], max_new_tokens=6)[0]
    assert again.token_ids == first.token_ids == ref_tokens(model, tok, SEED_MESSAGES, 6)
    assert all(c.cache == "hit" for c in again.chunks)
    assert again.stats.prefilled_tokens == 1 and again.stats.reused_tokens == len(again.prompt_ids)


def test_batch_mixing_hits_and_misses(tiny_llama):
    model, tok = tiny_llama
    eng = Engine(model, tok)
    eng.generate([OTHER], max_new_tokens=2)
    third = [{"role": "user", "content": "Bonjour, comment allez-vous ?"}]
    outs = eng.generate([SEED_MESSAGES, OTHER, third], max_new_tokens=8)
    for out, msgs in zip(outs, [SEED_MESSAGES, OTHER, third]):
        assert out.token_ids == ref_tokens(model, tok, msgs, 8)
    assert [c.cache for c in outs[1].chunks] == ["hit", "hit", "hit"]
    assert outs[0].chunks[0].cache == "hit" and outs[0].chunks[1].cache == "miss"


def test_small_budget_evicts_and_stays_correct(tiny_llama):
    model, tok = tiny_llama
    per_block = BlockPool.bytes_per_block(3, 2, 16, torch.float32)
    eng = Engine(model, tok, kv_budget_bytes=5 * per_block)
    for msgs in (SEED_MESSAGES, OTHER, SEED_MESSAGES):
        assert eng.generate([msgs], max_new_tokens=4)[0].token_ids == ref_tokens(model, tok, msgs, 4)
    assert eng.stats.evictions > 0


# --- attention --------------------------------------------------------------------------------

def test_lse_merge_of_split_keys_equals_whole_and_empty_is_identity():
    torch.manual_seed(0)
    q = torch.randn(1, 5, 4, 8)
    k = torch.randn(1, 9, 2, 8)
    v = torch.randn(1, 9, 2, 8)
    whole, lse = partial_attention(q, k, v, None, 0.3)
    oa, la = partial_attention(q, k[:, :4], v[:, :4], None, 0.3)
    ob, lb = partial_attention(q, k[:, 4:], v[:, 4:], None, 0.3)
    om, lm = merge_states(oa, la, ob, lb)
    torch.testing.assert_close(om, whole)
    torch.testing.assert_close(lm, lse)
    oe, le = partial_attention(q, k[:, :0], v[:, :0], None, 0.3)
    assert torch.isinf(le).all()
    o2, l2 = merge_states(oe, le, whole, lse)
    torch.testing.assert_close(o2, whole)
    o3, l3 = merge_states(oe, le, oe, le)
    assert not torch.isnan(o3).any() and torch.isinf(l3).all() and (o3 == 0).all()
    masked = torch.zeros(1, 5, 9, dtype=torch.bool)
    om2, lm2 = partial_attention(q, k, v, masked, 0.3)
    assert (om2 == 0).all() and torch.isinf(lm2).all()
    # natural log: lse of one key is its score
    _, l1 = partial_attention(q[:, :1, :1], k[:, :1, :1], v[:, :1, :1], None, 1.0)
    assert math.isclose(float(l1), float((q[0, 0, 0] * k[0, 0, 0]).sum()), rel_tol=1e-5)


def test_paged_decode_attends_each_row_to_its_own_slots():
    torch.manual_seed(0)
    pool = BlockPool(1, 2, 16, num_blocks=40, dtype=torch.float32, device=torch.device("cpu"))
    pool.k[0].normal_()
    pool.v[0].normal_()
    order = torch.randperm(40 * 16)
    key_slots = [order[i * 100:i * 100 + n].numpy() for i, n in enumerate((1, 17, 70))]
    q = torch.randn(3, 4, 16)
    plan = PagedDecode.build(key_slots, torch.device("cpu"))
    assert plan.new_slots.tolist() == [int(s[-1]) for s in key_slots]
    out = plan.attend(pool, 0, q, 0.25)
    for i, slots in enumerate(key_slots):
        idx = torch.from_numpy(slots)
        want, _ = partial_attention(q[i][None, None], pool.k[0][idx][None], pool.v[0][idx][None], None, 0.25)
        torch.testing.assert_close(out[i], want[0, 0])


@pytest.mark.parametrize("with_sinks", [False, True])
def test_paged_decode_gathers_keys_every_row_shares_once_and_attends_as_each_row_alone(with_sinks, monkeypatch):
    torch.manual_seed(1)
    pool = BlockPool(1, 2, 16, num_blocks=40, dtype=torch.float32, device=torch.device("cpu"))
    pool.k[0].normal_()
    pool.v[0].normal_()
    order = torch.randperm(40 * 16).numpy()
    head = order[:50]                               # a cached chunk every row reads first
    key_slots = [np.concatenate([head, order[100 + i * 40:100 + i * 40 + n]]) for i, n in enumerate((1, 9, 30))]
    q = torch.randn(3, 4, 16)
    sinks = torch.randn(4) if with_sinks else None
    plan = PagedDecode.build(key_slots, torch.device("cpu"))
    assert plan.shared == 50
    read = []
    monkeypatch.setattr(pool, "read", lambda layer, slots, real=pool.read: read.append(slots.numel()) or real(layer, slots))
    out = plan.attend(pool, 0, q, 0.25, sinks)
    assert read[0] == 50 and sum(read) == 50 + 3 * 30      # the shared keys once, then each row's own (padded)
    for i, slots in enumerate(key_slots):
        idx = torch.from_numpy(slots)
        o, lse = partial_attention(q[i][None, None], pool.k[0][idx][None], pool.v[0][idx][None], None, 0.25)
        want = o[0, 0] if sinks is None else with_sinks_of(o[0], lse[0], sinks)[0]
        torch.testing.assert_close(out[i], want)
    assert PagedDecode.build([key_slots[0]], torch.device("cpu")).shared == 0            # one row: no cascade
    assert PagedDecode.build([s[10:] for s in key_slots], torch.device("cpu")).shared == 40
    assert PagedDecode.build([s[30:] for s in key_slots], torch.device("cpu")).shared == 0   # 20 < MIN_SHARED


# --- exact numerics ---------------------------------------------------------------------------

def test_invariant_linear_rows_do_not_depend_on_row_count():
    # 1536 inputs: where a plain matmul's rows change bits with the row count on an AVX-512 CPU
    torch.manual_seed(0)
    w = torch.randn(96, 1536)
    x = torch.randn(300, 1536)
    whole = invariant_linear(x, w)
    for rows in list(range(1, 2 * CPU_ROW_TILE + 3)) + [64, 100, 177]:
        for start in (0, 3, 17, 101):
            assert torch.equal(invariant_linear(x[start:start + rows], w), whole[start:start + rows])


def test_exact_attention_same_bits_for_any_split():
    torch.manual_seed(0)
    L = 150
    q, k, v = torch.randn(L, 4, 16), torch.randn(L, 2, 16), torch.randn(L, 2, 16)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    whole = exact_attention(q, k, v, causal, 0.25)
    for p in (0, 1, 63, 64, 100, 149):
        one = exact_attention(q[p:p + 1], k[: p + 1], v[: p + 1], causal[p:p + 1, : p + 1], 0.25)
        assert torch.equal(one, whole[p:p + 1])
    part = exact_attention(q[70:90], k[:90], v[:90], causal[70:90, :90], 0.25)
    assert torch.equal(part, whole[70:90])


@pytest.mark.parametrize("keys", [129, 700, 2461])
def test_a_decode_steps_rows_over_all_key_tiles_at_once_get_the_tile_loops_bits(keys):
    """On the CPU a block of a few real rows (a decode step's) takes every key tile at once where a
    probe finds the two forms agree (`exact_attention._all_tiles_at_once`): every row, mask, window and sink
    must then give the loop's bits, and `exact_attention` the loop's bits whichever form it runs."""
    from kvdiff.engine import exact_attention as attention

    torch.manual_seed(keys)
    k, v, sinks = torch.randn(keys, 3, 64), torch.randn(keys, 3, 64), torch.randn(9)
    position = torch.arange(keys)[None]
    agrees = attention._at_once_agrees(3, 3, 64, 64)
    for rows in (1, 3, CPU_ROW_TILE):
        q = torch.randn(rows, 9, 64)
        last = torch.arange(keys - rows, keys)[:, None]
        masks = {"causal": position <= last, "window": (position <= last) & (position > last - 100),
                 "holes": torch.rand(rows, keys) > 0.7, "one row sees nothing": (position <= last) & (last > keys - rows)}
        for name, visible in masks.items():
            for sink in (None, sinks):
                loop = attention._tiled_attention(q, k, v, visible, 0.125, sink, False).nan_to_num(7.0)
                forms = [exact_attention(q, k, v, visible, 0.125, sink)]
                if agrees:
                    forms.append(attention._tiled_attention(q, k, v, visible, 0.125, sink, True))
                for form in forms:
                    assert torch.equal(form.nan_to_num(7.0), loop), (rows, name, sink is None)


def test_where_all_key_tiles_at_once_would_give_other_bits_the_loop_runs(monkeypatch):
    from kvdiff.engine import exact_attention as attention

    def off_by_a_bit(*args):             # as another CPU's matmuls might round
        out = real(*args)
        return out + out.abs().mul(2 ** -20)

    real = attention._all_tiles_at_once
    monkeypatch.setattr(attention, "_all_tiles_at_once", off_by_a_bit)
    monkeypatch.setattr(attention, "_AT_ONCE_AGREES", {})
    q, k, v = torch.randn(1, 4, 16), torch.randn(300, 2, 16), torch.randn(300, 2, 16)
    visible = torch.ones(1, 300, dtype=torch.bool)
    assert torch.equal(exact_attention(q, k, v, visible, 0.25), attention._tiled_attention(q, k, v, visible, 0.25, None,
                                                                                        False))
    assert attention._AT_ONCE_AGREES == {(2, 2, 16, 16): False}


def test_exact_numerics_restores_the_model(tiny_llama):
    model, tok = tiny_llama
    impl = model.config._attn_implementation
    with exact_numerics(model):
        assert model.config._attn_implementation == "kvdiff_exact"
        assert "forward" in model.lm_head.__dict__
    assert model.config._attn_implementation == impl and "forward" not in model.lm_head.__dict__


def test_exact_numerics_without_attention_patch_the_modules_only_and_nest(tiny_llama):
    """The engine runs attention itself: its exact numerics leave the model's attention as it is,
    and a use nested in them still switches it."""
    model, _ = tiny_llama
    impl = model.config._attn_implementation
    with exact_numerics(model, attention=False):
        assert model.config._attn_implementation == impl and "forward" in model.lm_head.__dict__
        with exact_numerics(model):
            assert model.config._attn_implementation == "kvdiff_exact"
        assert model.config._attn_implementation == impl and "forward" in model.lm_head.__dict__
    assert "forward" not in model.lm_head.__dict__


# --- strategies on every tiny family -------------------------------------------------------------

@pytest.mark.parametrize("strategy", [s.value for s in Strategy])
def test_every_strategy_runs_on_every_family(tiny_model, strategy):
    model, tok = tiny_model
    eng = Engine(model, tok, strategy=strategy)
    outs = eng.generate([SEED_MESSAGES, OTHER], max_new_tokens=6)
    assert all(len(o.token_ids) >= 1 for o in outs)
    if strategy in ("none", "prefix"):
        assert outs[0].token_ids == ref_tokens(model, tok, SEED_MESSAGES, 6)
    if strategy != "none":
        assert outs[1].chunks[0].cache == "hit"


def test_exact_prefix_bitwise_on_every_family(tiny_model):
    model, tok = tiny_model
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    eng = Engine(model, tok, numerics="exact")
    eng.generate([first], max_new_tokens=2)
    sink = ListSink()
    out = eng.generate([SEED_MESSAGES], max_new_tokens=6, sinks={0: sink})[0]
    with exact_numerics(model):
        ids = render_prompt_ids(tok, SEED_MESSAGES)
        cache = DynamicCache(config=model.config)
        ref = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, output_hidden_states=True)
    assert out.token_ids == ref_tokens(model, tok, SEED_MESSAGES, 6, exact=True)
    positions = list(range(len(ids)))
    for layer in range(model.config.num_hidden_layers):
        assert torch.equal(sink.stacked("k", layer, positions), cache.layers[layer].keys[0].transpose(0, 1))
        assert torch.equal(sink.stacked("v", layer, positions), cache.layers[layer].values[0].transpose(0, 1))
    computed = list(range(out.chunks[1].positions[0], len(ids)))
    for layer in range(1, model.config.num_hidden_layers):
        assert torch.equal(sink.stacked("resid_pre", layer, computed), ref.hidden_states[layer][0, computed])
    assert torch.equal(sink.stacked("logits", None, computed), ref.logits[0, computed])


def test_blend_ratio_one_gives_prefix_tokens(tiny_model):
    model, tok = tiny_model
    prefix = Engine(model, tok, strategy="prefix").generate([SEED_MESSAGES], max_new_tokens=8)[0]
    blend = Engine(model, tok, strategy="blend", recompute_ratio=1.0)
    blend.generate([OTHER], max_new_tokens=1)
    out = blend.generate([SEED_MESSAGES], max_new_tokens=8)[0]
    assert out.chunks[0].cache == "hit" and out.token_ids == prefix.token_ids


def test_blend_selects_the_largest_deviations():
    fresh = torch.zeros(10, 2, 4)
    cached = torch.zeros(10, 2, 4)
    cached[[2, 7]] = 5.0
    cached[4] = 1.0
    assert select_blend_tokens(fresh, cached, 0.2).tolist() == [2, 7]
    assert select_blend_tokens(fresh, cached, 0.0).numel() == 0
    assert select_blend_tokens(fresh, cached, 1.0).numel() == 10


# --- errors, sampling, probes --------------------------------------------------------------------

def test_input_errors(tiny_llama):
    model, tok = tiny_llama
    with pytest.raises(InputError, match="prefix"):
        Engine(model, tok, strategy="bogus")
    with pytest.raises(InputError, match="context"):
        Engine(model, tok).generate([SEED_MESSAGES], max_new_tokens=5000)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match="llama"):
        Engine(gpt2, tok)


def test_seeded_sampling_is_reproducible(tiny_llama):
    model, tok = tiny_llama
    runs = [Engine(model, tok, temperature=1.0, top_k=50, top_p=0.9, seed=7).generate([SEED_MESSAGES], 10)[0]
            for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids


def test_probe_protocol_isolated_local(tiny_llama):
    model, tok = tiny_llama
    eng = Engine(model, tok, strategy="isolated-local")
    eng.generate([OTHER], max_new_tokens=1)
    sink = ListSink()
    out = eng.generate([SEED_MESSAGES], max_new_tokens=3, sinks={0: sink})[0]
    n = len(out.prompt_ids)
    compute = [b for b in sink.brackets if ("resid_pre", 0) in b["fired"]]
    reuse = [b for b in sink.brackets if ("resid_pre", 0) not in b["fired"]]
    for b in compute:
        assert all(b["fired"].get((p, layer)) == 1 for p in LAYER_POINTS for layer in range(3))
    assert reuse[0]["positions"] == list(range(out.chunks[0].positions[0], out.chunks[0].positions[1] + 1))
    user = next(src for pos, src in sink.provenances if src.chunk == "user")
    assert list(user.encoded_positions)[0] == 0 and not user.reused
    system = next(src for pos, src in sink.provenances if src.chunk == "system")
    assert system.reused
    assert [s[0] for s in sink.steps] == list(range(len(out.token_ids)))
    assert sink.steps[0][1] == n - 1 and [s[3] for s in sink.steps] == out.token_ids
    assert out.chunks[1].encoded_positions == (0, out.chunks[1].positions[1] - out.chunks[1].positions[0])


def test_rerotated_keys_land_at_their_global_positions(tiny_llama):
    """rerotate's placed K equals K computed alone at the global positions (isolated-global), up to rounding."""
    model, tok = tiny_llama
    keys = {}
    for strategy in ("rerotate", "isolated-global"):
        sink = ListSink(points={"k"})
        out = Engine(model, tok, strategy=strategy).generate([SEED_MESSAGES], max_new_tokens=1, sinks={0: sink})[0]
        user = range(out.chunks[1].positions[0], out.chunks[1].positions[1] + 1)
        keys[strategy] = sink.stacked("k", 0, list(user))
    torch.testing.assert_close(keys["rerotate"], keys["isolated-global"], rtol=1e-5, atol=1e-5)


def test_probe_protocol_blend_traces_the_recomputed_tokens_as_computed(tiny_llama):
    model, tok = tiny_llama
    eng = Engine(model, tok, strategy="blend", recompute_ratio=0.25)
    eng.generate([OTHER], max_new_tokens=1)
    sink = ListSink()
    out = eng.generate([SEED_MESSAGES], max_new_tokens=2, sinks={0: sink})[0]
    system, user, generation = out.chunks
    source = {p: src for pos, src in sink.provenances for p in pos}          # a later report wins
    final_id = source[generation.positions[0]].prefill_id
    cached = range(system.positions[0], user.positions[1] + 1)
    recomputed = [p for p in cached if source[p].prefill_id == final_id]
    assert len(recomputed) == math.ceil(0.25 * len(cached))
    # The system chunk sits at its own positions, so its K matches the full-context K: the largest
    # deviations, and so every recomputed token, are in the user chunk, computed without the system.
    assert all(source[p].chunk == "user" and not source[p].reused for p in recomputed)
    final = next(b for b in sink.brackets if not b["reads_only"] and source[b["positions"][-1]].prefill_id == final_id)
    assert set(recomputed) <= set(final["positions"])
    reads = next(b for b in sink.brackets if b["reads_only"])
    assert reads["positions"] == [p for p in cached if p not in recomputed]   # the selection pass itself is scratch


def test_the_reference_path_hands_the_cache_under_the_name_the_forward_takes(tiny_llama):
    """transformers 5.2x renamed `past_key_values` to `cache` and warns on stderr for the old name
    (a line in every CLI run); 5.17-5.19 know only the old one."""
    class New:
        def forward(self, input_ids, cache=None, use_cache=None):
            pass

    class Old:
        def forward(self, input_ids, past_key_values=None, use_cache=None):
            pass

    assert (cache_keyword(New), cache_keyword(Old)) == ("cache", "past_key_values")
    model, tok = tiny_llama
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = reference_generate(model, tok, [{"role": "user", "content": "Hi"}], 3)
    assert len(out.token_ids) >= 1

"""Cascade attention's length buckets: bounded padding, the same attention as each group alone."""

from __future__ import annotations

import random

import pytest
import torch

import kvdiff.engine.partial_attention as partial
import kvdiff.engine.attention_plan as attention_plan
from kvdiff.engine import Engine
from kvdiff.engine.attention_plan import KeySet
from kvdiff.engine.cascade import PAD_SLACK, CascadePlan, plan_buckets
from kvdiff.engine.partial_attention import partial_attention
from kvdiff.engine.kv_cache import BlockPool

H, KVH, D = 4, 2, 8


def _cells(bucket, rows, keys):
    return len(bucket) * max(rows[i] for i in bucket) * max(keys[i] for i in bucket)


def test_groups_of_one_size_form_one_bucket():
    assert plan_buckets([16] * 32, [80] * 32) == [list(range(32))]


def test_one_long_group_is_not_padded_into_the_short_ones():
    rows = [37, 21, 28, 31, 1177, 13, 53, 16, 16, 13, 15, 15]
    buckets = plan_buckets(rows, rows)
    assert [4] in buckets
    assert sorted(i for b in buckets for i in b) == list(range(12))
    # the old single batch: 12 x 1177 x 1177 cells; now at most twice the groups' own, or PAD_SLACK a bucket
    own = sum(r * r for r in rows)
    padded = sum(_cells(b, rows, rows) for b in buckets)
    assert padded <= 2 * own + PAD_SLACK * len(buckets) < 12 * 1177 * 1177 // 5


@pytest.mark.parametrize("seed", range(20))
def test_every_bucket_keeps_within_its_bound(seed):
    rnd = random.Random(seed)
    n = rnd.randint(1, 40)
    rows = [rnd.choice([1, rnd.randint(1, 64), rnd.randint(1, 2000)]) for _ in range(n)]
    keys = [r + rnd.randint(0, 500) for r in rows]
    buckets = plan_buckets(rows, keys)
    assert sorted(i for b in buckets for i in b) == list(range(n))
    for b in buckets:
        assert b == sorted(b)
        own = sum(rows[i] * keys[i] for i in b)
        assert len(b) == 1 or _cells(b, rows, keys) <= max(2 * own, PAD_SLACK)


def _pool_and_keys(lengths, shared_len):
    """Groups of `lengths` rows after an optional `shared_len`-key chunk shared by every group but the last."""
    torch.manual_seed(0)
    pool = BlockPool(1, KVH, D, num_blocks=400, dtype=torch.float32, device=torch.device("cpu"))
    pool.k[0].normal_()
    pool.v[0].normal_()
    shared_slots = torch.arange(shared_len)
    spans, keys, start, nxt = [], [], 0, shared_len
    for i, T in enumerate(lengths):
        share = shared_len and i < len(lengths) - 1
        prefix = shared_slots if share else torch.arange(nxt, nxt + shared_len)
        nxt += 0 if share else shared_len
        own = torch.arange(nxt, nxt + T)
        nxt += T
        slots = torch.cat([prefix, own])
        kpos = torch.arange(shared_len + T)
        visible = kpos.unsqueeze(0) <= (shared_len + torch.arange(T)).unsqueeze(1)
        keys.append(KeySet(slots, visible, "sys" if share else None, shared_len if share else 0, False))
        spans.append(slice(start, start + T))
        start += T
    return pool, spans, keys


@pytest.mark.parametrize("shared_len", [0, 20])
def test_bucketed_attention_equals_each_group_alone(shared_len):
    lengths = [3, 5, 300, 4, 1, 6, 2]
    pool, spans, keys = _pool_and_keys(lengths, shared_len)
    plan = CascadePlan.build(spans, keys, torch.device("cpu"))
    assert len(plan.buckets) >= 2 and len(plan.shared) == (1 if shared_len else 0)
    assert max(b.groups * b.width for b in plan.buckets if b.width == 300) == 300   # the long group alone
    q = torch.randn(sum(lengths), H, D)
    out = plan.attend(pool, 0, q, 0.3)
    for span, kk in zip(spans, keys):
        k, v = pool.read(0, kk.slots)
        want, _ = partial_attention(q[span][None], k[None], v[None], kk.visible[None], 0.3)
        torch.testing.assert_close(out[span], want[0], rtol=1e-5, atol=1e-6)


def test_partial_attention_in_row_blocks_and_fused_equal_one_block(monkeypatch):
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 50, H, D), torch.randn(2, 70, KVH, D), torch.randn(2, 70, KVH, D)
    visible = torch.rand(2, 50, 70) > 0.3
    visible[:, :3] = False                                            # rows that see no key
    fused, fused_lse = partial_attention(q, k, v, visible, 0.3)
    monkeypatch.setattr(partial, "_fused", lambda q, v: False)        # the matmul form, as off the CPU
    whole, lse = partial_attention(q, k, v, visible, 0.3)
    torch.testing.assert_close(fused, whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_lse, lse, rtol=1e-5, atol=1e-6)
    assert torch.isinf(lse[:, :3]).all() and (whole[:, :3] == 0).all()
    monkeypatch.setattr(partial, "SCORE_BUDGET", 2 * H * 70 * 7)     # blocks of 7 rows
    blocked, blse = partial_attention(q, k, v, visible, 0.3)
    torch.testing.assert_close(blocked, whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(blse, lse, rtol=1e-6, atol=1e-6)


def test_a_long_prompt_among_short_ones_is_planned_alone_with_the_same_tokens(tiny_llama, monkeypatch):
    model, tok = tiny_llama
    long_system = " ".join(f"Rule {i}: answer briefly." for i in range(40))
    convs = [[{"role": "system", "content": long_system}, {"role": "user", "content": "Hi"}]] + [
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": f"Question {i}?"}] for i in range(5)]
    alone = [Engine(model, tok).generate([c], max_new_tokens=6)[0].token_ids for c in convs]
    plans, build = [], CascadePlan.build

    def spy(spans, keys, device):
        plans.append(build(spans, keys, device))
        return plans[-1]

    monkeypatch.setattr(attention_plan.CascadePlan, "build", staticmethod(spy))
    together = Engine(model, tok).generate(convs, max_new_tokens=6)
    assert [o.token_ids for o in together] == alone
    prefill = plans[0]
    long_rows = together[0].stats.prompt_tokens
    assert long_rows > 300
    widths = sorted(b.width for b in prefill.buckets)
    assert widths[-1] == long_rows and [b.groups for b in prefill.buckets if b.width == long_rows] == [1]


def test_a_hit_on_a_long_cached_chunk_reads_it_in_place_with_the_tokens_of_no_reuse(tiny_llama, monkeypatch):
    """On the CPU one request's new turn attends to a cached chunk of ONE_GROUP_CASCADE_KEYS keys
    or more apart (no mask, the chunk's consecutive slots read as views of the pool), and its
    decode steps read their own consecutive slots in place: the tokens stay those of no reuse."""
    model, tok = tiny_llama
    system = " ".join(f"Rule {i}: answer briefly and politely." for i in range(24))
    turn = [{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}]
    want = Engine(model, tok, strategy="none").generate([turn], max_new_tokens=6)[0].token_ids
    engine = Engine(model, tok, strategy="prefix")
    engine.generate([[turn[0], {"role": "user", "content": "Hi"}]], max_new_tokens=1)
    plans, build = [], CascadePlan.build

    def spy(spans, keys, device):
        plans.append(build(spans, keys, device))
        return plans[-1]

    monkeypatch.setattr(attention_plan.CascadePlan, "build", staticmethod(spy))
    hit = engine.generate([turn], max_new_tokens=6)[0]
    assert hit.stats.reused_tokens >= attention_plan.ONE_GROUP_CASCADE_KEYS
    assert hit.token_ids == want
    (part,) = plans[0].shared
    assert isinstance(part.slots, slice) and part.visible is None
    assert part.slots.stop - part.slots.start == hit.stats.reused_tokens


def test_a_causal_group_attends_with_sdpas_causal_mask_as_with_its_own(tiny_llama, monkeypatch):
    """A group whose rows are its keys (a cold prompt) is planned causal: SDPA's causal mask (flash
    attention on a GPU) gives what its visibility mask gives; the engine's cold prompt takes it."""
    pool, spans, keys = _pool_and_keys([300], 0)
    (masked,) = keys
    causal = KeySet(masked.slots, masked.visible, None, 0, False, diagonal=0)
    q = torch.randn(300, H, D)
    want = CascadePlan.build(spans, [masked], torch.device("cpu")).attend(pool, 0, q, 0.3)
    plan = CascadePlan.build(spans, [causal], torch.device("cpu"))
    assert plan.buckets[0].causal
    torch.testing.assert_close(plan.attend(pool, 0, q, 0.3), want, rtol=1e-5, atol=1e-6)

    model, tok = tiny_llama
    plans, build = [], CascadePlan.build

    def spy(spans, keys, device):
        plans.append(build(spans, keys, device))
        return plans[-1]

    monkeypatch.setattr(attention_plan.CascadePlan, "build", staticmethod(spy))
    Engine(model, tok, strategy="none").generate([[{"role": "user", "content": "Name a colour."}]], max_new_tokens=1)
    assert plans[0].buckets[0].causal

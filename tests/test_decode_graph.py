"""Decode steps from static buffers (what a CUDA graph replays), checked against the eager step.

The graphs themselves need a GPU (tests/test_gpu.py); here the static step runs eagerly on the
CPU, so what it reads is checked everywhere: tokens, positions, new slots, each window's slot
table, and padding rows that touch nothing but the scratch slot.
"""

from __future__ import annotations

import pytest
import torch

import kvdiff
from kvdiff.engine import Engine
from kvdiff.engine.decode_graph import BUCKETS, DecodeGraphs, decode_rows, graphs_apply
from kvdiff.engine.tiny import build_tiny_model

from conftest import SEED_MESSAGES, SHARING_SYSTEM


def _conversations(n: int) -> list[list[dict]]:
    base = [SEED_MESSAGES, SHARING_SYSTEM]
    return [base[i % 2][:-1] + [{"role": "user", "content": f"Question {i}: {base[i % 2][-1]['content']}"}]
            for i in range(n)]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-gpt-oss"])
def test_the_static_step_gives_the_eager_steps_logits_and_padding_writes_only_scratch(name):
    # windows of 32 keys: the conversations run past them, so the windowed tables are cut
    model, tok = build_tiny_model(name, **({} if name == "tiny-llama" else {"sliding_window": 32}))
    eng = Engine(model, tok, strategy="prefix", cuda_graphs=False, kv_budget_bytes=2**22)
    static = DecodeGraphs(eng.runner)
    for k in eng.pool.k:
        k.fill_(float("nan"))        # so that any write shows, even of the zeros a padding row may write
    steps = []
    eager_forward = eng._decode_forward

    def both(groups):
        bucket = next(b for b in BUCKETS if b >= len(groups))
        static._fill(decode_rows(groups), bucket)
        before = [k.clone() for k in eng.pool.k]
        got = static._step(bucket)[:len(groups)]
        written = {int(s) for k, b in zip(eng.pool.k, before)
                   for s in (k.nan_to_num(7.0) != b.nan_to_num(7.0)).flatten(1).any(1).nonzero()}
        eager = eager_forward(groups)
        steps.append((len(groups), bucket, written))
        torch.testing.assert_close(got, torch.stack(eager), rtol=1e-4, atol=1e-4)
        return eager

    eng._decode_forward = both
    eng.generate(_conversations(3), max_new_tokens=6)
    assert [(b, bucket) for b, bucket, _ in steps] == [(3, 4)] * 5
    scratch = static.scratch_block * eng.pool.block_size
    written = [w for _, _, w in steps]
    assert scratch in written[0]                  # the padding row's K/V went to the scratch slot
    assert all(len(w - {scratch}) == 3 for w in written)          # each real row's to its new slot
    assert len(set().union(*written) - {scratch}) == 3 * 5


def test_graphs_are_for_fast_numerics_on_one_gpu_only(tiny_llama):
    model, tok = tiny_llama
    assert Engine(model, tok).graphs is None                  # the CPU: no graphs
    assert not graphs_apply(Engine(model, tok, numerics="exact").runner)
    moe, moe_tok = kvdiff.load_model("tiny-qwen3-moe")
    assert not graphs_apply(Engine(moe, moe_tok).runner)      # not on the CPU, and a router anyway


def test_a_cache_hits_new_turn_and_the_decode_run_as_graph_rows_and_give_the_eager_tokens():
    model, tok = build_tiny_model("tiny-gemma3", sliding_window=32)
    static, plain = Engine(model, tok, kv_budget_bytes=2**24), Engine(model, tok, kv_budget_bytes=2**24)
    static.graphs = DecodeGraphs(static.runner)      # off CUDA its static step runs eagerly
    rows = []
    replay = static.graphs.forward
    static.graphs.forward = lambda r: rows.append(len(r)) or replay(r)
    for convs in ([SEED_MESSAGES], [SHARING_SYSTEM, SEED_MESSAGES]):
        rows.clear()
        got, want = static.generate(convs, max_new_tokens=8), plain.generate(convs, max_new_tokens=8)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [c.cache for c in got[0].chunks] == ["hit", "miss", "miss"] and {c.cache for c in got[1].chunks} == {"hit"}
    new_turn = got[0].chunks[-1].positions[1] - got[0].chunks[0].positions[1]
    # one forward: the new turn's rows and the cached prompt's last row (which writes nothing); then decode
    assert rows == [new_turn + 1] + [2] * 7

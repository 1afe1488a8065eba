"""Decode steps from static buffers (what a CUDA graph replays), checked against the eager step.

The graphs themselves need a GPU (tests/test_gpu.py); here the static step runs eagerly on the
CPU, so what it reads is checked everywhere: tokens, positions, new slots, each window's slot
table, and padding rows that touch nothing but the scratch slot.
"""

from __future__ import annotations

import numpy as np
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


def _digest_run(model, tok, path, graphed: bool, captured: list | None = None, **window):
    """The seeds' conversation through a `prefix` engine with a digest recorder: with `graphed`,
    decode steps go through DecodeGraphs (off CUDA its static step runs eagerly), and `captured`
    collects every (point, layer, rows) its decode steps' probes digest. Returns the trace and the
    (position, digested) of each step the graphs ran."""
    from kvdiff.engine.digest_probes import DigestProbes
    from kvdiff.probes.recorder import TraceRecorder

    eng = Engine(model, tok, strategy="prefix", kv_budget_bytes=2**24)
    if graphed:
        eng.graphs = DecodeGraphs(eng.runner)
    steps = []
    if captured is not None:
        capture, read = DigestProbes.capture, DigestProbes.read

        def keep(self, point, layer, rows):
            if self.selection.wants(point, layer) and not self.views:      # a decode graph's step: no views
                captured.append((point, layer, rows.clone()))
            capture(self, point, layer, rows)

        def keep_read(self, pool, layer, slots, value_point):     # the rows the cache holds at `slots`
            for point, table in (("k", pool.k[layer]), (value_point, pool.v[layer])):
                if self.selection.wants(point, layer) and not self.views:
                    captured.append((point, layer, table.index_select(0, slots)))
            read(self, pool, layer, slots, value_point)

        DigestProbes.capture, DigestProbes.read = keep, keep_read
    try:
        rec = TraceRecorder.for_model(model, tok, SEED_MESSAGES, path, strategy="prefix", max_new_tokens=6,
                                      trace_mode="digest", **window)
        if graphed:
            replay = eng.graphs.replay
            eng.graphs.replay = lambda rows, digested: steps.append((rows[0].encoded, digested is not None)) or replay(
                rows, digested)
        (out,) = eng.generate([SEED_MESSAGES], max_new_tokens=6, sinks={0: rec})
        return rec.finish(out.token_ids, out.text, out.chunks), steps
    finally:
        if captured is not None:
            DigestProbes.capture, DigestProbes.read = capture, read


def test_a_digest_traces_decode_steps_are_digested_inside_the_graphs_step(tmp_path):
    from kvdiff.analysis.digests import first_digest_mismatch
    from kvdiff.trace import open_trace
    from kvdiff.trace.digest import row_digests

    model, tok = build_tiny_model("tiny-llama")
    captured = []
    graphed, steps = _digest_run(model, tok, tmp_path / "graphed.h5", True, captured)
    eager, _ = _digest_run(model, tok, tmp_path / "eager.h5", False)
    assert [digested for _, digested in steps] == [True] * 5           # every decode step replayed a digesting step
    with open_trace(graphed) as g, open_trace(eager) as e:
        decode = g.digest_positions[-5:]
        # the prompt's rows are the eager forward's; the first decode row differs where the static
        # step's attention (the paged decode) rounds otherwise than the eager one's on the CPU
        assert first_digest_mismatch(g, e) == (0, "z", int(decode[0]))
        per_step = len(captured) // 5
        for n, (point, layer, rows) in enumerate(captured):
            position = int(decode[n // per_step])
            hashes, stats = g.digests(layer, point)
            at = int(np.flatnonzero(g.digest_positions == position)[0])
            assert hashes[at] == row_digests(rows)[0][0].item(), (point, layer, position)
            assert np.allclose(stats[at], e.digests(layer, point)[1][at], rtol=1e-4), (point, layer)
        assert {(p, l) for p, l, _ in captured} == {(p, l) for l in g.meta.digest_layers for p in g.meta.digest_points
                                                  if p not in ("final_norm", "logits")} | {
            ("final_norm", None), ("logits", None)}


def test_decode_steps_in_the_zoom_window_or_of_a_full_trace_run_eagerly(tmp_path):
    model, tok = build_tiny_model("tiny-llama")
    n = len(kvdiff.conversation.render_prompt_ids(tok, SEED_MESSAGES))
    _, steps = _digest_run(model, tok, tmp_path / "zoom.h5", True, layers="1", positions=f"{n + 1}-{n + 2}")
    assert steps == [(n, True), (n + 3, True), (n + 4, True)]       # the window's two steps recorded as they ran
    eng = Engine(model, tok, strategy="prefix", kv_budget_bytes=2**24)
    eng.graphs = DecodeGraphs(eng.runner)
    rec = kvdiff.probes.recorder.TraceRecorder.for_model(model, tok, SEED_MESSAGES, tmp_path / "full.h5",
                                                         strategy="prefix", max_new_tokens=6)
    eng.graphs.replay = lambda rows, digested: pytest.fail("a full trace's decode step replayed a graph")
    (out,) = eng.generate([SEED_MESSAGES], max_new_tokens=6, sinks={0: rec})
    rec.finish(out.token_ids, out.text, out.chunks)


def test_graphed_decode_steps_reach_their_sink_a_batch_of_steps_at_a_time(tmp_path, monkeypatch):
    from dataclasses import astuple

    from kvdiff.analysis.digests import first_digest_mismatch
    from kvdiff.engine import step_digests
    from kvdiff.probes.recorder import TraceRecorder
    from kvdiff.trace import open_trace

    model, tok = build_tiny_model("tiny-llama")
    brackets = []
    begin = TraceRecorder.begin_forward
    monkeypatch.setattr(TraceRecorder, "begin_forward",
                        lambda self, positions, reads_only=False: brackets.append(list(positions)) or begin(
                            self, positions, reads_only))
    whole, _ = _digest_run(model, tok, tmp_path / "whole.h5", True)
    n = brackets[-1][0]
    assert brackets[-1] == list(range(n, n + 5))        # five steps, held to the end of the decode: one bracket
    brackets.clear()
    monkeypatch.setattr(step_digests, "STEPS_HELD", 2)
    batched, _ = _digest_run(model, tok, tmp_path / "batched.h5", True)
    assert brackets[-3:] == [[n, n + 1], [n + 2, n + 3], [n + 4]]
    with open_trace(whole) as w, open_trace(batched) as b:
        assert first_digest_mismatch(w, b) is None
        assert np.array_equal(w.digest_positions, b.digest_positions) and w.digest_positions[-1] == n + 4
        assert [np.asarray(x).tolist() for x in astuple(w.provenance)] == \
            [np.asarray(x).tolist() for x in astuple(b.provenance)]


def test_batched_graph_steps_hand_each_sink_its_own_rows(tmp_path, monkeypatch):
    from kvdiff.analysis.digests import first_digest_mismatch
    from kvdiff.engine import step_digests
    from kvdiff.probes.recorder import TraceRecorder
    from kvdiff.trace import open_trace
    from kvdiff.trace.digest import row_digests

    model, tok = build_tiny_model("tiny-llama")
    other = [{"role": "user", "content": "Name three rivers of Europe and say which is longest."}]

    def run(tag: str, recorded: tuple[int, ...]) -> list:
        eng = Engine(model, tok, strategy="prefix", kv_budget_bytes=2**24)
        eng.graphs = DecodeGraphs(eng.runner)
        convs = [SEED_MESSAGES, other]
        recs = {i: TraceRecorder.for_model(model, tok, convs[i], tmp_path / f"{tag}{i}.h5", strategy="prefix",
                                           max_new_tokens=7, trace_mode="digest") for i in recorded}
        outs = eng.generate(convs, max_new_tokens=7, sinks=recs)
        return [recs[i].finish(outs[i].token_ids, outs[i].text, outs[i].chunks) for i in recorded]

    whole = run("whole", (0, 1))
    monkeypatch.setattr(step_digests, "STEPS_HELD", 4)
    held = run("held", (0, 1))
    alone = run("alone", (0,))
    for a, b in ((whole[0], held[0]), (whole[1], held[1]), (whole[0], alone[0])):
        with open_trace(a) as x, open_trace(b) as y:
            assert first_digest_mismatch(x, y) is None
            assert len(x.digest_positions) == len(x.meta.input_ids) + 6      # the prompt and six decode steps
    embed = model.get_input_embeddings().weight
    for path in held:         # each sink got its own rows: a decode row's layer-0 input is its token's embedding
        with open_trace(path) as t:
            n = len(t.meta.input_ids)
            hashes, _ = t.digests(0, "resid_pre")
            for p, token in zip(range(n, n + 6), t.meta.generated_ids):
                at = int(np.flatnonzero(t.digest_positions == p)[0])
                assert hashes[at] == row_digests(embed[token].unsqueeze(0))[0][0].item(), (path, p)

"""CUDA: the engine, reference, probes and analyzer on a GPU, in each dtype.

Skipped without CUDA. Run through the device tool on random-initialised models of the default
model's shape with its real tokenizer (docs/gpu.md says how); results are in docs/gpu.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import kvdiff
from kvdiff.run.compare import compare
from kvdiff.engine import Engine
from kvdiff.engine.numerics import exact_attention, exact_numerics, invariant_linear
from kvdiff.engine.reference import reference_generate
from test_engine_real import SUITE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from shapes import random_model  # noqa: E402  (the benchmarks' models of real shapes)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (see docs/gpu.md)")

TOKENIZER = Path(os.environ.get("KVDIFF_GPU_TOKENIZER", Path(__file__).parents[1] / ".gpu" / "tokenizer"))
SHAPE = "smollm2-135m"
NEW = 6
DTYPES = ["bfloat16", "float16", "float32"]


@pytest.fixture(scope="module", params=DTYPES)
def gpu_model(request):
    model, tok = random_model(SHAPE, TOKENIZER, dtype=request.param, device="cuda")
    return request.param, model, tok


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    model, tok = random_model(SHAPE, TOKENIZER, dtype="bfloat16", device="cuda")
    folder = tmp_path_factory.mktemp("random-smollm2-bf16")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


SPLITS = [(0, 1), (5, 6), (37, 200), (64, 128), (299, 300)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_exact_operations_give_every_row_the_same_bits_whatever_rows_beside_it(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from kvdiff.engine import gpu_kernels

    torch.manual_seed(0)
    T, H, KVH, D, hidden = 300, 32, 8, 64, 2048
    q = torch.randn(T, H, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(T, KVH, D, device="cuda", dtype=dtype) for _ in range(2))
    visible = torch.ones(T, T, dtype=torch.bool, device="cuda").tril()
    x = torch.randn(T, hidden, device="cuda", dtype=dtype)
    w = torch.randn(4 * hidden, hidden, device="cuda", dtype=dtype) * hidden ** -0.5
    norm = LlamaRMSNorm(hidden).to("cuda", dtype)
    attn, mm, normed = exact_attention(q, k, v, visible, 0.125), invariant_linear(x, w), gpu_kernels.rms_norm(x, norm.weight, 1e-6)
    assert torch.equal(exact_attention(q, k, v, visible, 0.125, diagonal=0), attn)    # the mask computed, not read
    for a, b in SPLITS:
        assert torch.equal(exact_attention(q[a:b], k[:b], v[:b], visible[a:b, :b], 0.125), attn[a:b])
        assert torch.equal(exact_attention(q[a:b], k[:b], v[:b], visible[a:b, :b], 0.125, diagonal=a), attn[a:b])
        assert torch.equal(invariant_linear(x[a:b], w), mm[a:b])
        assert torch.equal(gpu_kernels.rms_norm(x[a:b], norm.weight, 1e-6), normed[a:b])
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(normed, norm(x), rtol=tol, atol=tol)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).float(), k.repeat_interleave(H // KVH, 1).transpose(0, 1).float(),
        v.repeat_interleave(H // KVH, 1).transpose(0, 1).float(), is_causal=True, scale=0.125).transpose(0, 1)
    torch.testing.assert_close(attn.float(), dense, rtol=tol, atol=tol)


@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (9, 3), (4, 4)])
@pytest.mark.parametrize("window, with_sinks", [(None, False), (None, True), (300, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_exact_decode_rows_get_the_bits_of_the_prefill_whatever_their_segments(dtype, window, with_sinks, heads,
                                                                               kv_heads):
    """The exact decode kernel (a row's 256-key segments side by side, merged afterwards) gives a
    row at any position the bits the prefill kernel gives it: rows at segment edges, one key
    into a segment, past several segments, in a batch of rows of different lengths."""
    from kvdiff.engine import gpu_kernels

    torch.manual_seed(1)
    T, H, KVH, D = 1100, 8, 2, 64
    q = torch.randn(T, H, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(T, KVH, D, device="cuda", dtype=dtype) for _ in range(2))
    sinks = torch.randn(H, device="cuda") if with_sinks else None
    i, j = torch.arange(T, device="cuda")[:, None], torch.arange(T, device="cuda")[None, :]
    visible = (j <= i) & (j > i - window) if window else j <= i
    prefill = gpu_kernels.attention(q, k, v, visible, 0.125, sinks)
    rows = torch.tensor([0, 63, 255, 256, 511, 700, 1099], device="cuda")
    table = torch.arange(T, device="cuda", dtype=torch.int64).expand(len(rows), T).contiguous()
    decoded = gpu_kernels.paged_attention(q[rows], k, v, table, rows + 1, window, 0.125, sinks)
    assert torch.equal(decoded, prefill[rows])


@pytest.mark.parametrize("splits", [None, 1, 3, 16])      # None: as many as key_splits chooses
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_paged_decode_kernel_matches_gathered_attention(dtype, with_sinks, splits):
    from kvdiff.engine import paged_kernel
    from kvdiff.engine.kv_cache import BlockPool
    from kvdiff.engine.paged_decode import PagedDecode

    torch.manual_seed(0)
    H, KVH, D = 9, 3, 64
    pool = BlockPool(1, KVH, D, num_blocks=1000, dtype=dtype, device=torch.device("cuda"))
    pool.k[0].normal_()
    pool.v[0].normal_()
    order = torch.randperm(1000 * 16)
    key_slots = [order[i * 3000:i * 3000 + n].numpy() for i, n in enumerate((1, 63, 64, 65, 2461))]
    q = torch.randn(len(key_slots), H, D, device="cuda", dtype=dtype)
    sinks = torch.randn(H, device="cuda") if with_sinks else None
    plan = PagedDecode.build(key_slots, torch.device("cuda"))
    fused = paged_kernel.paged_decode(q, pool.k[0], pool.v[0], plan.table, plan.lengths, 0.125, sinks, splits)
    assert paged_kernel.key_splits(len(key_slots) * KVH, q.device) > 1     # the default splits these rows' keys
    paged_kernel.available = False      # the gather-and-SDPA path
    try:
        gathered = plan.attend(pool, 0, q, 0.125, sinks)
    finally:
        paged_kernel.available = True
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(fused, gathered, rtol=tol, atol=tol)


def test_gpu_fingerprint_is_stable_and_sees_a_one_ulp_change():
    from kvdiff.trace.fingerprint import model_fingerprint

    model, _ = random_model(SHAPE, TOKENIZER, dtype="bfloat16", device="cuda")
    twin, _ = random_model(SHAPE, TOKENIZER, dtype="bfloat16", device="cuda")
    first = model_fingerprint(model)
    assert first == model_fingerprint(twin) and "/wg:" in first
    with torch.no_grad():
        model.model.layers[7].mlp.down_proj.weight.view(torch.int16)[3, 5] += 1   # one bf16 ulp
    assert model_fingerprint(model) != first


def test_gpu_weight_hash_kernel_matches_the_torch_form(monkeypatch):
    """The Triton hash against the torch form, for every word size, sizes that do not fill the
    last block, an empty tensor and more than 2**31 words (64-bit indices)."""
    from kvdiff.trace import fingerprint as model_meta, hash_kernel

    assert hash_kernel.available
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randn(3001, 577, device="cuda", generator=gen).to(torch.bfloat16),
               torch.randn(1_000_003, device="cuda", generator=gen),
               torch.randn(2, 3, device="cuda", dtype=torch.float64, generator=gen),
               torch.randint(0, 256, (2**31 + 4097,), device="cuda", dtype=torch.uint8, generator=gen),
               torch.empty(0, device="cuda", dtype=torch.bfloat16)]
    by_kernel = model_meta.gpu_weight_digests(tensors)
    monkeypatch.setattr(hash_kernel, "available", False)
    monkeypatch.setattr(model_meta, "_HASH_CHUNK", 1 << 20)
    assert model_meta.gpu_weight_digests(tensors) == by_kernel
    assert len(set(by_kernel)) == len(tensors)


def test_prefix_exact_tokens_match_reference_on_the_suite(gpu_model):
    dtype, model, tok = gpu_model
    with exact_numerics(model):
        refs = [reference_generate(model, tok, c, NEW).token_ids for c in SUITE]
    eng = Engine(model, tok, strategy="prefix", numerics="exact")
    outs = eng.generate(SUITE[:8], max_new_tokens=NEW) + eng.generate(SUITE[8:], max_new_tokens=NEW)
    assert [o.token_ids for o in outs] == refs
    assert outs[2].chunks[0].cache == "hit"


@pytest.mark.parametrize("index", range(len(SUITE)))
def test_prefix_exact_is_bitwise_identical_in_bf16(bf16_folder, tmp_path, index):
    result = compare(SUITE[index], model=str(bf16_folder), strategy="prefix", numerics="exact",
                     max_new_tokens=NEW, dtype="bfloat16", device="cuda", out=tmp_path / "run")
    assert result.report.to_json()["tokens_identical"]
    assert result.report.to_json()["first_bit_difference"] is None, json.dumps(result.report.to_json()["first_bit_difference"])


@pytest.mark.parametrize("index", range(len(SUITE)))
def test_prefix_exact_reading_every_chunk_from_the_cache_is_bitwise_identical_in_bf16(bf16_folder, tmp_path, index):
    result = compare(SUITE[index], model=str(bf16_folder), strategy="prefix", numerics="exact", warm=True,
                     max_new_tokens=NEW, dtype="bfloat16", device="cuda", out=tmp_path / "run")
    assert {c["cache"] for c in result.report.to_json()["chunks"]} == {"hit"}
    assert result.report.to_json()["tokens_identical"]
    assert result.report.to_json()["first_bit_difference"] is None, json.dumps(result.report.to_json()["first_bit_difference"])


def test_isolated_local_is_diagnosed_on_the_gpu(bf16_folder, tmp_path):
    result = compare(SUITE[0], model=str(bf16_folder), strategy="isolated-local", numerics="exact",
                     max_new_tokens=NEW, dtype="bfloat16", device="cuda", out=tmp_path / "run")
    first = result.report.to_json()["first_divergence"]
    assert (first["layer"], first["position"]) == (0, 16)
    user = [d for d in result.report.to_json()["diagnoses"] if d["kind"] == "position_mismatch" and d["chunk"] == "user"]
    assert user and user[0]["offset"] == -16


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (the nvidia-h200-x2 kind)")


@two_gpus
@pytest.mark.parametrize("numerics", ["exact", "fast"])
def test_a_model_split_across_two_gpus_gives_the_tokens_of_one_gpu(bf16_folder, numerics):
    single, tok = kvdiff.load_model(str(bf16_folder), dtype="bfloat16", device="cuda:0")
    weights = sum(p.numel() * p.element_size() for p in single.parameters())
    budget = weights * 7 // 10 // 2**20           # MiB: the model does not fit one GPU's share
    split, _ = kvdiff.load_model(str(bf16_folder), dtype="bfloat16", device_map="auto", gpu_memory=f"{budget}MiB")
    assert {p.device.index for p in split.parameters()} == {0, 1}
    for gpu in (0, 1):
        assert sum(p.numel() * p.element_size() for p in split.parameters() if p.device.index == gpu) <= budget * 2**20
    outs = {}
    for name, model in (("single", single), ("split", split)):
        with exact_numerics(model) if numerics == "exact" else contextlib.nullcontext():
            refs = [reference_generate(model, tok, c, NEW).token_ids for c in SUITE[:8]]
        # (no CUDA graphs: a split model's steps run eagerly, and fast numerics' graphed steps may
        # differ from eager ones in their last bits)
        eng = Engine(model, tok, strategy="prefix", numerics=numerics, cuda_graphs=False)
        outs[name] = (refs, [o.token_ids for o in eng.generate(SUITE[:8], max_new_tokens=NEW)])
    assert outs["split"] == outs["single"]


@two_gpus
def test_probes_and_diff_work_on_a_split_model(bf16_folder, tmp_path):
    from kvdiff.trace.fingerprint import model_fingerprint

    split, tok = kvdiff.load_model(str(bf16_folder), dtype="bfloat16", device_map="balanced")
    single, _ = kvdiff.load_model(str(bf16_folder), dtype="bfloat16", device="cuda:0")
    assert model_fingerprint(split) == model_fingerprint(single)      # hashed on each GPU, one wait per GPU
    for name, model in (("split", split), ("single", single)):
        with exact_numerics(model):
            kvdiff.record(model, tok, SUITE[0], tmp_path / f"{name}.h5", max_new_tokens=NEW, numerics="exact")
    across = kvdiff.diff(tmp_path / "single.h5", tmp_path / "split.h5")
    assert across.tokens_identical and across.first_bit_difference is None
    same = compare(SUITE[0], model=str(bf16_folder), strategy="prefix", numerics="exact", max_new_tokens=NEW,
                   dtype="bfloat16", device_map="balanced", out=tmp_path / "prefix")
    assert same.report.to_json()["first_bit_difference"] is None
    local = compare(SUITE[0], model=str(bf16_folder), strategy="isolated-local", numerics="exact",
                    max_new_tokens=NEW, dtype="bfloat16", device_map="balanced", out=tmp_path / "local")
    user = [d for d in local.report.to_json()["diagnoses"] if d["kind"] == "position_mismatch" and d["chunk"] == "user"]
    assert user and user[0]["offset"] == -16


@pytest.mark.parametrize("numerics", ["fast", "exact"])
@pytest.mark.parametrize("batch", [1, 3, 4])
def test_decode_graphs_replay_the_eager_decode(gpu_model, batch, numerics):
    """Each graphed decode step against the eager step on the same rows: the same bits in exact
    numerics, and in fast ones where the batch fills its bucket (the same kernels on the same
    shapes); close logits with padding rows."""
    from kvdiff.engine.decode_graph import BUCKETS, decode_rows

    dtype, model, tok = gpu_model
    eng = Engine(model, tok, strategy="prefix", numerics=numerics)
    sizes = []

    def both(groups):
        got = torch.stack(eng.graphs.forward(decode_rows(groups))).clone()
        want = torch.stack(eng._forward(groups))
        sizes.append(len(groups))
        if len(groups) in BUCKETS or numerics == "exact":
            assert torch.equal(got, want)
        tol = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 5e-2}[dtype]
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        return list(got)

    eng._decode_forward = both
    eng.generate(SUITE[:batch], max_new_tokens=12)
    assert sizes and sizes[0] == batch
    assert ({1: 1, 3: 4, 4: 4}[batch], None) in eng.graphs.graphs


@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_decode_graphs_follow_sliding_windows_past_their_end(numerics):
    from kvdiff.engine.tiny import build_tiny_model

    model, tok = build_tiny_model("tiny-gemma3", sliding_window=32)
    model = model.to("cuda")
    convs = SUITE[:4]
    got = [o.token_ids for o in Engine(model, tok, numerics=numerics).generate(convs, max_new_tokens=40)]
    want = [o.token_ids for o in Engine(model, tok, numerics=numerics, cuda_graphs=False).generate(convs, max_new_tokens=40)]
    assert got == want


def test_a_full_trace_decodes_eagerly(bf16_folder, tmp_path, monkeypatch):
    from kvdiff.engine.decode_graph import DecodeGraphs

    def refuse(self, rows, digested):
        raise AssertionError("a decode step recorded in full replayed a graph")

    monkeypatch.setattr(DecodeGraphs, "replay", refuse)
    result = compare(SUITE[0], model=str(bf16_folder), strategy="prefix", numerics="fast", trace_mode="full",
                     max_new_tokens=NEW, dtype="bfloat16", device="cuda", out=tmp_path / "run")
    assert result.report.to_json()["tokens_identical"] is not None


@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_a_digest_traces_graphed_decode_steps_hash_the_eager_steps_bits(bf16_folder, tmp_path, numerics):
    """Decode steps digested inside their CUDA graph (graph_probes.py) give the digests of the
    same steps run eagerly, bit for bit, at every point, layer and position."""
    from kvdiff.analysis.digests import first_digest_mismatch
    from kvdiff.engine.decode_graph import DecodeGraphs
    from kvdiff.probes.recorder import TraceRecorder
    from kvdiff.trace import open_trace

    model, tok = kvdiff.load_model(str(bf16_folder), dtype="bfloat16", device="cuda")
    traces, replays = [], []
    replay = DecodeGraphs.replay

    def counted(self, rows, digested):
        replays.append(digested is not None)
        return replay(self, rows, digested)

    for graphs in (True, False):
        eng = Engine(model, tok, strategy="prefix", numerics=numerics, cuda_graphs=graphs)
        if graphs:
            eng.graphs.replay = counted.__get__(eng.graphs)
        rec = TraceRecorder.for_model(model, tok, SUITE[0], tmp_path / f"{graphs}.h5", strategy="prefix",
                                      numerics=numerics, max_new_tokens=24, trace_mode="digest")
        (out,) = eng.generate([SUITE[0]], max_new_tokens=24, sinks={0: rec})
        traces.append((rec.finish(out.token_ids, out.text, out.chunks), out.token_ids))
    assert traces[0][1] == traces[1][1]
    assert replays == [True] * (len(traces[0][1]) - 1) and len(replays) > 4
    with open_trace(traces[0][0]) as graphed, open_trace(traces[1][0]) as eager:
        assert first_digest_mismatch(graphed, eager) is None
        for layer, point in ((0, "q"), (29, "resid_post"), (None, "logits")):
            assert np.array_equal(graphed.digests(layer, point)[1], eager.digests(layer, point)[1])


def test_a_decode_graph_cuda_refuses_to_capture_runs_eagerly_with_a_warning(bf16_folder, monkeypatch, caplog):
    """Where CUDA refuses a capture, those steps run eagerly, with the same tokens, and the log
    says so."""
    model, tok = kvdiff.load_model(str(bf16_folder), dtype="bfloat16", device="cuda")
    want = Engine(model, tok, strategy="prefix", cuda_graphs=False).generate([SUITE[0]], max_new_tokens=NEW)[0]

    class Refused:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            raise torch.AcceleratorError("CUDA error: operation failed due to a previous error during capture")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "graph", Refused)
    engine = Engine(model, tok, strategy="prefix")
    with caplog.at_level("WARNING", logger="kvdiff"):
        got = engine.generate([SUITE[0]], max_new_tokens=NEW)[0]
    assert got.token_ids == want.token_ids and set(engine.graphs.graphs.values()) == {None}
    assert "could not capture a decode graph for 1 rows (CUDA error: operation failed" in caplog.text


@pytest.mark.parametrize("numerics", ["fast", "exact"])
def test_a_cache_hits_new_turn_replays_a_graph(bf16_folder, numerics):
    model, tok = kvdiff.load_model(str(bf16_folder), dtype="bfloat16", device="cuda")
    graphed, eager = (Engine(model, tok, strategy="prefix", numerics=numerics, cuda_graphs=on) for on in (True, False))
    for eng in (graphed, eager):
        eng.generate([SUITE[1]], max_new_tokens=2)                 # caches the conversation's first turn
    rows, replay = [], graphed.graphs.forward
    graphed.graphs.forward = lambda r: rows.append(len(r)) or replay(r)
    got, want = (eng.generate([SUITE[2]], max_new_tokens=NEW)[0] for eng in (graphed, eager))
    assert got.chunks[0].cache == "hit" and 1 < rows[0] <= 64 and rows[1:] == [1] * (len(got.token_ids) - 1)
    # exact numerics: the graph's rows have the eager prefill's bits, so every token is the same
    assert got.token_ids[:2] == want.token_ids[:2] if numerics == "fast" else got.token_ids == want.token_ids


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_rope_kernel_is_apply_rope(dtype):
    from kvdiff.engine import rope_kernel
    from kvdiff.engine.adapters import apply_rope

    gen = torch.Generator(device="cuda").manual_seed(0)
    for T, H, D in [(1, 9, 64), (37, 32, 128), (5, 8, 96)]:
        x = torch.randn(T, H, D, device="cuda", generator=gen).to(dtype)
        angle = torch.rand(T, D // 2, device="cuda", generator=gen).repeat(1, 2) * 100
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
        tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
        torch.testing.assert_close(rope_kernel.rotate(x, cos, sin), apply_rope(x, cos, sin), rtol=tol, atol=tol)
        if rope_kernel.rounds_like_torch(x, cos, sin):      # exact numerics: apply_rope's bits
            assert torch.equal(rope_kernel.rotate(x, cos, sin, rounded=True), apply_rope(x, cos, sin))

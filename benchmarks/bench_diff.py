"""Benchmark `kvdiff.diff` on two large synthetic traces: throughput and peak memory.

Writes a reference and a candidate trace (SmolLM2-135M shapes: 30 layers, hidden 576, 9 query
heads, 3 KV heads of 64, vocab 49152 unless --vocab says otherwise) with TraceWriter, then times
the diff. The candidate matches the reference bitwise up to a position, carries rounding-size
noise after it, and diverges in the last quarter, so every stage does its work. Memory: the
diff's peak resident memory (Linux) and, from a second run, the peak of traced allocations.

    python benchmarks/bench_diff.py --positions 1700 --dir /tmp/kvdiff-bench
"""

from __future__ import annotations

import argparse
import logging
import time
import tracemalloc
from pathlib import Path

import numpy as np
import torch

import kvdiff
from kvdiff.trace.points import LAYER_POINTS
from kvdiff.trace import ModelDims, TraceMeta, TraceWriter, open_trace

log = logging.getLogger("bench_diff")
LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 30, 576, 9, 3, 64
BLOCK = 256


def _meta(n_prompt: int, vocab: int, strategy: str) -> TraceMeta:
    return TraceMeta(
        kvdiff_version=kvdiff.__version__, model_name="bench", model_fingerprint="bench", tokenizer_fingerprint="bench",
        dtype="float32", device="cpu", torch_version=torch.__version__, transformers_version="none", strategy=strategy,
        numerics="fast", messages=[], input_ids=np.arange(n_prompt, dtype=np.int64), dims=ModelDims(
            num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, hidden_size=HIDDEN,
            vocab_size=vocab, attn_scale=HEAD_DIM ** -0.5), points=LAYER_POINTS + ("final_norm", "logits"), layers=tuple(range(LAYERS)))


def write_pair(folder: Path, positions: int, vocab: int) -> tuple[Path, Path]:
    """Reference and candidate traces; rows are random, the candidate perturbed after positions/2."""
    rng = np.random.default_rng(0)
    paths = (folder / "reference.h5", folder / "candidate.h5")
    writers = [TraceWriter(paths[0], _meta(positions, vocab, "reference")),
               TraceWriter(paths[1], _meta(positions, vocab, "prefix"))]
    noisy_from, broken_from = positions // 2, 3 * positions // 4
    dims = writers[0].meta.dims
    groups = [(f"layers/{i}", LAYER_POINTS) for i in range(LAYERS)] + [("final", ("final_norm", "logits"))]
    for group, points in groups:
        for point in points:
            row = dims.point_shape(point)
            for lo in range(0, positions, BLOCK):
                hi = min(positions, lo + BLOCK)
                x = rng.standard_normal((hi - lo, *row), dtype=np.float32)
                y = x.copy()
                pos = np.arange(lo, hi)
                y[pos >= noisy_from] *= np.float32(1 + 2e-7)
                y[pos >= broken_from] += np.float32(0.1)
                writers[0].write_rows(group, point, pos, torch.from_numpy(x))
                writers[1].write_rows(group, point, pos, torch.from_numpy(y))
    for w in writers:
        w.close(generated_ids=[], text="")
    return paths


def reset_peak_rss() -> None:
    """Start the resident-memory high-water mark afresh (Linux), so writing the traces does not count."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss() -> int:
    """Bytes of the resident-memory high-water mark since the last reset (Linux VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, default=1700)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/kvdiff-bench"))
    ap.add_argument("--reuse", action="store_true", help="Diff traces already in --dir.")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.reuse:
        ref, cand = args.dir / "reference.h5", args.dir / "candidate.h5"
    else:
        t = time.perf_counter()
        ref, cand = write_pair(args.dir, args.positions, args.vocab)
        log.info("wrote traces in %.1f s", time.perf_counter() - t)
    with open_trace(ref) as tr:
        n = int(tr.positions.size)
    layer_bytes = n * (8 * HIDDEN + HEADS * HEAD_DIM + 3 * KV_HEADS * HEAD_DIM) * 4
    final_bytes = n * (HIDDEN + args.vocab) * 4
    reset_peak_rss()
    t = time.perf_counter()
    div = kvdiff.diff(ref, cand)
    seconds = time.perf_counter() - t
    rss = peak_rss()
    tracemalloc.start()                      # a second run, traced, for the peak (tracing slows it)
    kvdiff.diff(ref, cand)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    compared = div.comparison.bytes_compared
    log.info("traces: %.2f GB + %.2f GB on disk", ref.stat().st_size / 1e9, cand.stat().st_size / 1e9)
    log.info("diff: %.1f s, %.0f MB/s over both traces (%.2f GB compared)", seconds, compared / seconds / 1e6, compared / 1e9)
    log.info("one layer of one trace: %.1f MB; final points of one trace: %.1f MB", layer_bytes / 1e6, final_bytes / 1e6)
    log.info("peak traced allocations: %.1f MB (%.2fx one layer); peak resident memory of the untraced run %.1f MB",
             peak / 1e6, peak / layer_bytes, rss / 1e6)
    log.info("first divergence: %s", div.first_divergence)


if __name__ == "__main__":
    main()

"""Two-GPU benchmark: a model split across the GPUs of one host against the same model on one GPU.

    python benchmarks/bench_split.py --tokenizer .gpu/tokenizer [--shape llama-3.2-1b llama-3.1-8b] [--pairs 3]

Needs two CUDA GPUs (the nvidia-h200-x2 kind of the device tool; docs/gpu.md says how); with fewer
it says so and exits with `kvdiff bench`'s status for a skipped benchmark. Each shape is saved as a
random-initialised bfloat16 folder and loaded twice: on GPU 0, and with `device_map="auto"` under a
per-GPU budget of 70% of its weights, so that it cannot sit on one GPU. Rows per shape: decode
tokens/s at batch 1 and 32 (the split model decodes eagerly, so it is set against the one-GPU
engine with and without CUDA graphs), time to first token of a cache hit on a 2,455-token chunk
and of the cold prompt, and digest capture (the default of `compare`) on vs off on the split model.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import kvdiff  # noqa: E402
from bench_engine import conv  # noqa: E402
from bench_gpu import (BATCH, PAIRS, SYSTEM_2K, Row, Setup, bench_digest, decode_rate, print_rows,  # noqa: E402
                       warm_ttft)
from kvdiff.cli.ci import BENCHMARK_SKIPPED  # noqa: E402
from kvdiff.engine import Engine  # noqa: E402
from shapes import REAL_SHAPES, random_model  # noqa: E402

SHAPES = ("llama-3.2-1b", "llama-3.1-8b")
HIT_TURNS = ("Name a colour.", "Name a river in Europe.", "Name a metal.")   # new turns after the cached chunk
KV_BUDGET = 2**31      # each engine's KV pool: several engines share GPU 0, so none takes a share of what is free


def load_single_and_split(shape: str, tokenizer: str, folder: str):
    """`(single, split, tok, budget_mib)`: one random model of `shape` on GPU 0 and the same weights
    loaded from a folder across both GPUs under a per-GPU budget it does not fit."""
    single, tok = random_model(shape, tokenizer, dtype="bfloat16", device="cuda:0")
    single.save_pretrained(folder)
    tok.save_pretrained(folder)
    budget = sum(p.numel() * p.element_size() for p in single.parameters()) * 7 // 10 // 2**20
    split, _ = kvdiff.load_model(folder, dtype="bfloat16", device_map="auto", gpu_memory=f"{budget}MiB")
    return single, split, tok, budget


def decode_rows(single, split, tok) -> list[Row]:
    """Decode tokens/s at batch 1 and BATCH: the split model against one GPU with and without graphs."""
    one = [conv("You are a helpful assistant.", "Write a long story about a dragon.")]
    many = [conv("You are a helpful assistant.", f"Story {i}: write about a dragon named {i}.") for i in range(BATCH)]
    graphed, eager, parted = (Engine(model, tok, cuda_graphs=graphs, kv_budget_bytes=KV_BUDGET)
                              for model, graphs in ((single, True), (single, False), (split, True)))
    rows = []
    for batch, convs in ((1, one), (BATCH, many)):
        rates = {name: decode_rate(lambda n, eng=eng: eng.generate(convs, max_new_tokens=n), batch)
                 for name, eng in (("graphed", graphed), ("eager", eager), ("split", parted))}
        rows += [Row(f"decode tokens/s, batch {batch}: one GPU (graphs) vs split", rates["graphed"], rates["split"],
                     rates["split"] / rates["graphed"], "report"),
                 Row(f"decode tokens/s, batch {batch}: one GPU eager vs split (both eager)", rates["eager"],
                     rates["split"], rates["split"] / rates["eager"], "report")]
    return rows


def ttft_rows(single, split, tok) -> list[Row]:
    """Time to first token, cold and on a cache hit of a 2,455-token system chunk (the median of
    HIT_TURNS' hits), one GPU vs split."""
    firsts = {}
    for name, model in (("single", single), ("split", split)):
        Engine(model, tok, strategy="prefix", kv_budget_bytes=KV_BUDGET).generate([conv(SYSTEM_2K, "Hi")],
                                                                                  max_new_tokens=1)    # compile
        firsts[name] = warm_ttft(model, tok, SYSTEM_2K, HIT_TURNS, KV_BUDGET)
        gc.collect()          # engines hold their KV pools in reference cycles
    (cold_1, hit_1), (cold_2, hit_2) = firsts["single"], firsts["split"]
    return [Row("TTFT, cold 2,455-token prompt: one GPU vs split, s", cold_1, cold_2, cold_2 / cold_1, "report"),
            Row("TTFT, cached 2,455-token chunk (hit): one GPU vs split, s", hit_1, hit_2, hit_2 / hit_1, "report"),
            Row("  split: cached chunk vs no reuse, s", cold_2, hit_2, cold_2 / hit_2, "speed-up")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default=".gpu/tokenizer", help="folder of the default model's tokenizer")
    parser.add_argument("--shape", nargs="+", default=list(SHAPES), choices=list(REAL_SHAPES), help="model shapes")
    parser.add_argument("--pairs", type=int, default=PAIRS, help="alternated pairs per capture row")
    args = parser.parse_args()
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    if torch.cuda.device_count() < 2:
        print("bench_split: skipped, it needs two CUDA GPUs (the nvidia-h200-x2 kind; docs/gpu.md)", file=sys.stderr)
        sys.exit(BENCHMARK_SKIPPED)
    print(f"devices {torch.cuda.device_count()} x {torch.cuda.get_device_name()}, torch {torch.__version__}, bfloat16")
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVDIFF_BENCH_DIR")) as work:
        for shape in args.shape:
            folder = os.path.join(work, shape)
            single, split, tok, budget = load_single_and_split(shape, args.tokenizer, folder)
            placed = {gpu: sum(p.numel() * p.element_size() for p in split.parameters() if p.device.index == gpu)
                      for gpu in (0, 1)}
            rows = decode_rows(single, split, tok) + ttft_rows(single, split, tok)
            rows += bench_digest(Setup(split, tok, work, args.pairs))
            title = (f"{shape}: split under {budget} MiB per GPU, weights {placed[0] / 2**30:.2f} GB on GPU 0 "
                     f"and {placed[1] / 2**30:.2f} GB on GPU 1")
            del single, split
            gc.collect()
            torch.cuda.empty_cache()
            print_rows(title, rows)


if __name__ == "__main__":
    main()

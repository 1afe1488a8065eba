"""Capture cost: a fully probed prefill (HDF5 write included) against the plain prefill.

    python benchmarks/bench_capture.py [--model smollm2-135m] [--tokens 2000] [--compression lzf]

Both runs prefill the same `--tokens` prompt tokens once into a fresh DynamicCache (after one
short warm-up forward). The probed run records every probe point of every layer and position
plus norm statistics, and its time includes closing the trace (the file is complete on disk).
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import torch

import kvdiff
from kvdiff.conversation import render_prompt_ids
from kvdiff.probes.hooks import attach_probes
from kvdiff.probes.recorder import TraceRecorder

log = logging.getLogger("bench_capture")
TEXT = ("You are a helpful assistant. Always answer in French. What is the capital of France? "
        "Chunked prefill reuses the key and value cache of a system prompt across requests. ")


def prompt(tokenizer, n_tokens: int) -> tuple[list[dict], list[int]]:
    messages = [{"role": "user", "content": TEXT * (n_tokens // 20 + 1)}]
    ids = render_prompt_ids(tokenizer, messages)
    if len(ids) < n_tokens:
        raise SystemExit(f"prompt has only {len(ids)} tokens")
    return messages, ids[:n_tokens]


@torch.no_grad()
def prefill(model, ids: list[int], probes=None) -> None:
    from transformers import DynamicCache

    if probes is not None:
        probes.begin_forward(range(len(ids)))
    model(input_ids=torch.tensor([ids]), past_key_values=DynamicCache(config=model.config), use_cache=True)
    if probes is not None:
        probes.end_forward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--compression", default=None, choices=["gzip", "lzf"])
    parser.add_argument("--out", type=Path, default=None, help="folder for the trace (default: a temp folder)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    model, tokenizer = kvdiff.load_model(args.model)
    messages, ids = prompt(tokenizer, args.tokens)
    prefill(model, ids[:64])  # warm-up

    t0 = time.perf_counter()
    prefill(model, ids)
    plain = time.perf_counter() - t0

    with tempfile.TemporaryDirectory(dir=args.out) as folder:
        path = Path(folder) / "capture.h5"
        t0 = time.perf_counter()
        recorder = TraceRecorder.for_model(model, tokenizer, messages, path, input_ids=ids,
                                           compression=args.compression)
        setup = time.perf_counter() - t0
        t0 = time.perf_counter()
        with attach_probes(model, recorder) as probes:
            prefill(model, ids, probes)
        recorder.finish([], "")
        probed = time.perf_counter() - t0
        size = path.stat().st_size

    overhead = probed - plain
    log.info("model %s, %d-token prefill, torch %s, %d threads", args.model, len(ids), torch.__version__,
             torch.get_num_threads())
    log.info("plain prefill          %.2f s", plain)
    log.info("probed prefill + write %.2f s  (ratio %.2fx)", probed, probed / plain)
    log.info("trace setup            %.2f s  (fingerprints, norm weights; once per trace)", setup)
    log.info("trace size             %.0f MB (compression %s)", size / 1e6, args.compression)
    log.info("write throughput       %.0f MB/s over the probed run, %.0f MB/s over the capture overhead",
             size / 1e6 / probed, size / 1e6 / overhead if overhead > 0 else float("inf"))


if __name__ == "__main__":
    main()

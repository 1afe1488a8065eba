"""Capture cost inside each engine under test: a request recorded from the engine's own tensors
(every probe point it gives, HDF5 trace closed) against the same request unprobed, on the same
engine instance, as the median of alternated pairs.

    python benchmarks/bench_engines.py [--engines transformers,vllm,llama.cpp] [--tokens 600] [--new 32] [--pairs 5]
                                       [--trace-mode digest|full]

Both runs of a pair are cold (the engine's cache dropped first). Engines that are not installed
are skipped with their reason. `--trace-mode`: digest (the default of `compare --engine`: a hash
of every row) or full (every row). Goal (issue #26): probed <= 1.5x unprobed.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kvdiff  # noqa: E402
from kvdiff.conversation import render_prompt_ids  # noqa: E402
from kvdiff.errors import InputError  # noqa: E402
from kvdiff.probes.recorder import TraceRecorder  # noqa: E402
from kvdiff.targets.registry import EngineName, open_target  # noqa: E402

log = logging.getLogger("bench_engines")
TEXT = ("You are a helpful assistant. Always answer in French. Chunked prefill reuses the key and value cache "
        "of a system prompt across requests, and a cache hit must not change a single token. ")


def conversation(tokenizer, n_tokens: int) -> tuple[list[dict], list[int]]:
    messages = [{"role": "system", "content": TEXT * (n_tokens // 30 + 1)}, {"role": "user", "content": "Why?"}]
    return messages, render_prompt_ids(tokenizer, messages)


def timed(target, ids, new, sink=None) -> float:
    target.reset_cache()
    start = time.perf_counter()
    run = target.generate(ids, new, sink=sink)
    if sink is not None:
        sink.finish(run.token_ids, run.text)
    return time.perf_counter() - start


def bench(name: str, model, tokenizer, messages, ids, new: int, pairs: int, folder: Path, mode: str) -> None:
    try:
        target = open_target(EngineName.parse(name), model, tokenizer)
    except InputError as exc:
        print(f"{name}: skipped ({exc})")
        return
    try:
        timed(target, ids, new)                       # warm-up: first-call costs out of the pairs
        plain, probed = [], []
        for i in range(pairs):
            recorder = TraceRecorder.for_model(model, tokenizer, messages, folder / f"{name}-{i}.h5", input_ids=ids,
                                               capture=target.points, max_new_tokens=new, strategy=name,
                                               numerics="engine", trace_mode=mode)
            probed.append(timed(target, ids, new, recorder))
            plain.append(timed(target, ids, new))
            (folder / f"{name}-{i}.h5").unlink()
        ratios = [p / q for p, q in zip(probed, plain)]
        print(f"{name} {target.info.version}, {mode} capture: {len(ids)} prompt + {new} new tokens, unprobed "
              f"{statistics.median(plain):.3f} s, probed {statistics.median(probed):.3f} s, "
              f"ratio median {statistics.median(ratios):.2f}x (min {min(ratios):.2f}, max {max(ratios):.2f}), "
              f"{pairs} alternated pairs; goal <= 1.5x")
    finally:
        target.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="transformers,vllm,llama.cpp")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=600)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--trace-mode", default="digest", choices=["digest", "full"])
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    model, tokenizer = kvdiff.load_model(args.model)
    messages, ids = conversation(tokenizer, args.tokens)
    with tempfile.TemporaryDirectory() as folder:
        for name in args.engines.split(","):
            bench(name, model, tokenizer, messages, ids, args.new, args.pairs, Path(folder), args.trace_mode)


if __name__ == "__main__":
    main()

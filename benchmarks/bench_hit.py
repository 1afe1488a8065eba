"""A cache hit's fixed cost: time to first token of a `prefix` hit on a tiny random model, where
model compute is negligible and the host's work per request is what is left; prints the stages.

    /work/main/.venv/bin/python benchmarks/bench_hit.py [--pairs 30] [--numerics fast|exact] [--threads 1]

Each pair is one request of a new user turn after a cached ~2,000-token system prompt (a registry
hit) and the same request on an engine without reuse (strategy `none`), alternated. The stages
are timed by wrapping the engine's functions in the hit runs.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import kvdiff  # noqa: E402
from kvdiff.engine import Engine, engine  # noqa: E402
from kvdiff.engine.attention_plan import ForwardAttention  # noqa: E402
from kvdiff.engine.planner import Planner  # noqa: E402
from kvdiff.engine.runner import ModelRunner  # noqa: E402

SYSTEM = " ".join(f"Rule {i}: answer briefly." for i in range(118))     # 2,007 tokens of the tiny tokenizer


class Stages:
    """Seconds spent in each wrapped function, per request while `on`."""

    def __init__(self):
        self.runs: list[dict[str, float]] = []
        self.on = False

    def _add(self, name: str, since: float) -> None:
        if self.on:
            self.runs[-1][name] = self.runs[-1].get(name, 0.0) + time.perf_counter() - since

    def medians(self) -> dict[str, float]:
        return {name: statistics.median(run.get(name, 0.0) for run in self.runs) for name in self.runs[0]}

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            since = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._add(name, since)
        setattr(owner, attr, timed)


def conv(user: str):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--numerics", choices=("fast", "exact"), default="fast")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: the host's cost, not two threads' contention on a shared VM)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = kvdiff.load_model("tiny-llama")
    stages = Stages()
    stages.wrap(engine, "split_conversation", "split (render, tokenize, boundary check)")
    stages.wrap(Planner, "plan_prefix", "plan (keys, registry lookup, block table)")
    stages.wrap(ForwardAttention, "build", "attention plan (key sets, cascade), in forward")
    stages.wrap(ModelRunner, "forward", "forward (3 layers, uncached rows x cached keys)")
    stages.wrap(engine.Engine, "_decode", "first token (argmax, stats)")
    hit = Engine(model, tok, strategy="prefix", numerics=args.numerics)
    none = Engine(model, tok, strategy="none", numerics=args.numerics)
    hit.generate([conv("What is the capital of France?")], max_new_tokens=1)       # caches the system chunk
    for i in range(5):
        hit.generate([conv(f"Warm-up {i}.")], max_new_tokens=1)
        none.generate([conv(f"Warm-up {i}.")], max_new_tokens=1)
    walls, ttfts, cold = [], [], []
    for i in range(args.pairs):
        messages = conv(f"Name colour number {i}.")
        cold.append(none.generate([messages], max_new_tokens=1)[0].stats.ttft_s)
        stages.on = True
        stages.runs.append({})
        since = time.perf_counter()
        out = hit.generate([messages], max_new_tokens=1)[0]
        walls.append(time.perf_counter() - since)
        stages.on = False
        ttfts.append(out.stats.ttft_s)
    assert out.chunks[0].cache == "hit", out.chunks
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; tiny-llama, {args.numerics} numerics, prompt {out.stats.prompt_tokens} "
          f"tokens, {out.stats.reused_tokens} reused, {out.stats.prefilled_tokens} computed; {args.pairs} pairs")
    print(f"cache-hit fixed cost, tiny model (host-bound), ms: {statistics.median(walls) * 1e3:.2f} "
          f"(generate's wall time, median; min {min(walls) * 1e3:.2f}); "
          f"stats.ttft_s {statistics.median(ttfts) * 1e3:.2f}")
    print(f"TTFT no reuse / hit: {statistics.median(cold) * 1e3:.2f} / {statistics.median(ttfts) * 1e3:.2f} ms = "
          f"{statistics.median(cold) / statistics.median(ttfts):.1f}x (stats.ttft_s, medians)")
    print("stages (median ms a hit):")
    medians = stages.medians()
    for name, seconds in medians.items():
        print(f"  {name:52} {seconds * 1e3:6.3f}")
    rest = statistics.median(w - sum(s for n, s in run.items() if "in forward" not in n)
                             for w, run in zip(walls, stages.runs))
    print(f"  {'other (numerics context, outputs, release)':52} {rest * 1e3:6.3f}")


if __name__ == "__main__":
    main()

"""Engine benchmarks on the default model, each a ratio from one run; prints a table.

    /work/main/.venv/bin/python benchmarks/bench_engine.py
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import kvdiff  # noqa: E402
from kvdiff.engine import Engine  # noqa: E402
from kvdiff.conversation import render_prompt_ids  # noqa: E402

SYSTEM_2K = " ".join(f"Rule {i}: answer briefly, politely and in plain words." for i in range(170))
DECODE_TOKENS = 64
REPEATS = 3


def conv(system: str, user: str):
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def hf_generate(model, tok, messages, new_tokens):
    ids = torch.tensor([render_prompt_ids(tok, messages)], device=model.device)
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=tok.pad_token_id or 0)


def fastest_numerics(model, tok, strategy: str, warm_up, measure) -> dict[str, float]:
    """`measure(engine)`'s best of REPEATS alternated runs for a fast and an exact engine, each
    warmed up on `warm_up` first."""
    engines = {numerics: Engine(model, tok, strategy=strategy, numerics=numerics) for numerics in ("fast", "exact")}
    for eng in engines.values():
        eng.generate([warm_up], max_new_tokens=2)
    best = {numerics: float("inf") for numerics in engines}
    for _ in range(REPEATS):
        for numerics, eng in engines.items():
            best[numerics] = min(best[numerics], measure(eng))
    return best


def main() -> None:
    torch.manual_seed(0)
    model, tok = kvdiff.load_model("smollm2-135m")
    rows = []

    # 1. TTFT with a cached ~2,000-token system chunk vs no reuse; the hit's median over turns of
    # several lengths (a single hit's time moves by a third between runs on a shared 2-core VM).
    eng = Engine(model, tok, strategy="prefix")
    n_sys = len(render_prompt_ids(tok, conv(SYSTEM_2K, "Hi")))
    cold = eng.generate([conv(SYSTEM_2K, "What is the capital of France?")], max_new_tokens=1)[0].stats.ttft_s
    turns = ["Name a colour.", "Name a fruit that is red.", "Which river runs through Paris, please?",
             "Say hello.", "Name three birds that cannot fly at all."]
    warm = statistics.median(eng.generate([conv(SYSTEM_2K, t)], max_new_tokens=1)[0].stats.ttft_s for t in turns)
    rows.append(("TTFT, cached %d-token system chunk vs no reuse (hit: median of %d)" % (n_sys, len(turns)),
                 cold, warm, cold / warm, ">= 60x"))

    # 2. Decode tokens/s vs transformers generate, batch 1.
    msgs = conv("You are a helpful assistant.", "Write a long story about a dragon.")
    hf_generate(model, tok, msgs, 4)
    Engine(model, tok, strategy="prefix").generate([msgs], max_new_tokens=2)
    hf_tps = eng_tps = 0.0
    for _ in range(REPEATS):      # alternated, best of each: other jobs share this machine
        hf_s, _ = timed(lambda: hf_generate(model, tok, msgs, DECODE_TOKENS))
        hf_prefill, _ = timed(lambda: hf_generate(model, tok, msgs, 1))
        hf_tps = max(hf_tps, (DECODE_TOKENS - 1) / (hf_s - hf_prefill))
        out = Engine(model, tok, strategy="prefix").generate([msgs], max_new_tokens=DECODE_TOKENS)[0]
        n = out.stats.generated_tokens
        eng_tps = max(eng_tps, (n - 1) / (out.stats.total_s - out.stats.ttft_s))
    rows.append(("decode tokens/s vs transformers generate (batch 1, %d tokens)" % n, hf_tps, eng_tps,
                 eng_tps / hf_tps, ">= 1.5x"))

    # 3. 16 requests sharing one system chunk vs 16 sequential generate calls.
    shared = " ".join(f"Guideline {i}: be accurate and kind." for i in range(60))
    convs = [conv(shared, f"Question {i}: what is {i} plus {i}?") for i in range(16)]
    seq_s, _ = timed(lambda: [hf_generate(model, tok, c, 16) for c in convs])
    eng = Engine(model, tok, strategy="prefix")
    batch_s, _ = timed(lambda: eng.generate(convs, max_new_tokens=16))
    rows.append(("16 requests sharing a system chunk vs 16 sequential generate", seq_s, batch_s,
                 seq_s / batch_s, ">= 10x"))

    # 4. exact vs fast numerics on the same request: one engine a side, as a server keeps one (a new
    # engine hashes the weights, ~0.2 s on both sides), strategy none so that each run computes
    # the whole prompt.
    req = conv("You are a helpful assistant.", "Write a long story about a dragon.")
    times = fastest_numerics(model, tok, "none", req,
                             lambda eng: timed(lambda: eng.generate([req], max_new_tokens=32))[0])
    rows.append(("exact vs fast numerics, same request (up to 32 new tokens), time",
                 times["fast"], times["exact"], times["exact"] / times["fast"], "<= 1.3x"))

    # 5. The same over a long context: decode steps over a cached 2,455-token chunk (exact numerics'
    # key tiles, 39 a row), the chunk cached by the warm-up.
    long = conv(SYSTEM_2K, "Write a long story about a dragon.")

    def step_s(eng) -> float:
        stats = eng.generate([long], max_new_tokens=17)[0].stats
        return (stats.total_s - stats.ttft_s) / (stats.generated_tokens - 1)

    step = fastest_numerics(model, tok, "prefix", long, step_s)
    rows.append(("exact vs fast numerics, decode step over a cached %d-token chunk" % n_sys, step["fast"],
                 step["exact"], step["exact"] / step["fast"], "none"))

    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    print(f"{'benchmark':66} {'baseline':>10} {'engine':>10} {'ratio':>8}  goal")
    for name, base, ours, ratio, goal in rows:
        print(f"{name:66} {base:10.4f} {ours:10.4f} {ratio:7.2f}x  {goal}")


if __name__ == "__main__":
    main()

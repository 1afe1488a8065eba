"""GPU benchmarks on random-initialised models of real shapes; each figure a ratio from one run.

    python benchmarks/bench_gpu.py --tokenizer .gpu/tokenizer [--shape smollm2-135m llama-3.2-1b llama-3.1-8b] [--only capture ...]

Needs a CUDA GPU (run it through the device tool; docs/gpu.md says how); without one it says so
and exits with `kvdiff bench`'s status for a skipped benchmark. Prints one table per
shape: exact vs fast numerics, full capture on vs off (HDF5 written to local disk; and, for
context, against the plain run plus the time the disk takes for the trace's bytes alone), time to
first token with an 8,000-token cached chunk vs no reuse, decode tokens/s vs transformers
`generate` at batch 1 and 32.

The lent machines' host timings wander by 2x between runs of the same code, so the numerics and
capture rows time the two sides in alternated pairs (`--pairs`, default 7) and report the median
time of each side, the median of the pairs' ratios and the pairs' lowest and highest ratio.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import kvdiff  # noqa: E402
from bench_engine import conv, hf_generate  # noqa: E402
from kvdiff.cli.ci import BENCHMARK_SKIPPED  # noqa: E402
from kvdiff.engine import Engine  # noqa: E402
from kvdiff.engine.numerics import exact_numerics  # noqa: E402
from kvdiff.run.model_cache import ModelKey  # noqa: E402
from kvdiff.trace.fingerprint import model_fingerprint  # noqa: E402
from kvdiff.conversation import render_prompt_ids  # noqa: E402
from kvdiff.engine.reference import reference_generate  # noqa: E402
from kvdiff.probes.recorder import TraceRecorder  # noqa: E402
from shapes import DEFAULT_SHAPES, REAL_SHAPES, random_model  # noqa: E402

SYSTEM_2K = " ".join(f"Rule {i}: answer briefly, politely and in plain words." for i in range(170))
SYSTEM_8K = " ".join(f"Clause {i}: the assistant keeps every answer short, exact and kind." for i in range(470))
NEW = 32
BATCH = 32
REPEATS = 3        # best-of for the disk alone
SCALE = {"tokens": 32768}   # bench_scale's prompt length (--scale-tokens)
DIGEST_PATHS = {"paths": ("reference", "engine")}    # bench_digest's sides (--digest-paths)
PAIRS = 7          # alternated (baseline, kvdiff) pairs for the numerics and capture rows; --pairs


def timed(fn) -> float:
    """Wall time of fn() with the GPU drained before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


@dataclass
class Row:
    """One line of the table: the two sides' times (or rates), their ratio, the goal, and for
    paired rows the lowest and highest ratio of the pairs."""

    name: str
    baseline: float
    kvdiff: float
    ratio: float
    goal: str
    spread: tuple[float, float] | None = None


@dataclass
class Setup:
    """What every benchmark gets: the model, its tokenizer, a folder for traces, and how many
    alternated pairs a paired row times."""

    model: torch.nn.Module
    tok: object
    trace_dir: str
    pairs: int


def paired(setup: Setup, name: str, baseline: Callable[[], None], ours: Callable[[], None], goal: str,
           before_ours: Callable[[], None] = lambda: None) -> Row:
    """`setup.pairs` alternated timings of `baseline` and `ours` (each after an untimed `before_ours`):
    median times, the median ratio of the pairs and their range."""
    base, mine = [], []
    for _ in range(setup.pairs):
        base.append(timed(baseline))
        before_ours()
        mine.append(timed(ours))
    ratios = [m / b for b, m in zip(base, mine)]
    return Row(name, statistics.median(base), statistics.median(mine), statistics.median(ratios), goal,
               (min(ratios), max(ratios)))


def hf_batch_generate(model, tok, convs, new_tokens):
    """transformers generate on a left-padded batch, greedy, exactly `new_tokens` each."""
    rows = [render_prompt_ids(tok, c) for c in convs]
    width = max(len(r) for r in rows)
    pad = tok.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=model.device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=model.device)
    return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=pad)


def decode_rate(run, batch: int) -> float:
    """Tokens/s of decoding alone: (NEW - 1) steps x batch over time(NEW tokens) - time(1 token)."""
    run(2)
    return batch * (NEW - 1) / (timed(lambda: run(NEW)) - timed(lambda: run(1)))


def bench_numerics(setup: Setup) -> list[Row]:
    model, tok = setup.model, setup.tok
    long_req = conv(SYSTEM_2K, "What is the capital of France?")
    n_long = len(render_prompt_ids(tok, long_req))

    def reference_exact() -> None:
        with exact_numerics(model):
            reference_generate(model, tok, long_req, NEW)

    # One engine per side, as a server keeps one (its decode graphs captured once); no chunk
    # cache, so that every run prefills the whole prompt.
    fast, exact = (Engine(model, tok, strategy="none", numerics=n, kv_budget_bytes=2**31) for n in ("fast", "exact"))
    for eng in (fast, exact):
        eng.generate([long_req], max_new_tokens=NEW)
    for _ in range(3):      # transformers' host-bound loop took 3-4 runs to settle (1.25 -> 0.73 s on 135M)
        reference_generate(model, tok, long_req, NEW)
        reference_exact()
    return [paired(setup, f"engine exact vs fast, {n_long}-token prompt + {NEW} tokens, s",
                   lambda: fast.generate([long_req], max_new_tokens=NEW),
                   lambda: exact.generate([long_req], max_new_tokens=NEW), "<= 1.1x"),
            paired(setup, "reference exact vs fast, same request, s",
                   lambda: reference_generate(model, tok, long_req, NEW), reference_exact, "<= 1.1x")]


def bench_capture(setup: Setup) -> list[Row]:
    model, tok, trace_dir, rows = setup.model, setup.tok, setup.trace_dir, []
    kvdiff.record(model, tok, conv("Hi", "Hi"), os.path.join(trace_dir, "warm.h5"), max_new_tokens=2)
    long_req = conv(SYSTEM_2K, "What is the capital of France?")
    for req, new in ((long_req, NEW), (conv(SYSTEM_2K[:2000], "Tell me a long story."), 256)):
        path = os.path.join(trace_dir, f"capture-{new}.h5")
        n_prompt = len(render_prompt_ids(tok, req))

        def remove_trace() -> None:     # untimed: replacing the last run's trace frees its blocks (0.2-0.7 s)
            if os.path.exists(path):
                os.remove(path)

        row = paired(setup, "", lambda: reference_generate(model, tok, req, new),
                     lambda: kvdiff.record(model, tok, req, path, max_new_tokens=new), "<= 1.5x", remove_trace)
        size = os.path.getsize(path)
        os.remove(path)
        row.name = f"full capture on vs off, {n_prompt} + {new} tokens, HDF5 {size / 1e9:.2f} GB, s"
        floor = row.baseline + disk_write_time(trace_dir, size)
        rows += [row, Row("  the same (medians) vs the plain run + writing the trace's bytes to that disk, s",
                          floor, row.kvdiff, row.kvdiff / floor, "context")]
    return rows


def bench_digest(setup: Setup) -> list[Row]:
    """Digest capture (the default of compare) on vs off, a prompt-heavy and a decode-heavy
    request: the reference path (transformers' forward with taps), and kvdiff's engine (one
    engine for both sides, its decode steps replaying CUDA graphs, which digest the captures)."""
    model, tok, trace_dir, rows = setup.model, setup.tok, setup.trace_dir, []
    fingerprint = model_fingerprint(model)      # once per model, as compare does (bench_digest.py too)
    engine = Engine(model, tok, strategy="none", kv_budget_bytes=2**31)

    def engine_run(req, new: int, path: str | None = None) -> None:
        sink = None if path is None else TraceRecorder.for_model(
            model, tok, req, path, strategy="none", fingerprint=fingerprint, max_new_tokens=new, trace_mode="digest")
        (out,) = engine.generate([req], max_new_tokens=new, sinks={} if sink is None else {0: sink})
        if sink is not None:
            sink.finish(out.token_ids, out.text, out.chunks)

    warm, warm_path = conv("Hi", "Hi"), os.path.join(trace_dir, "warm.h5")
    kvdiff.record(model, tok, warm, warm_path, max_new_tokens=2, trace_mode="digest", fingerprint=fingerprint)
    engine_run(warm, 4), engine_run(warm, 4, warm_path)
    for req, new in ((conv(SYSTEM_2K, "What is the capital of France?"), NEW),
                     (conv(SYSTEM_2K[:2000], "Tell me a long story."), 256)):
        path = os.path.join(trace_dir, f"digest-{new}.h5")
        n = len(render_prompt_ids(tok, req))

        def remove_trace() -> None:     # untimed: replacing the last run's trace frees its blocks (13-21 ms)
            if os.path.exists(path):
                os.remove(path)

        if "reference" in DIGEST_PATHS["paths"]:
            row = paired(setup, "", lambda: reference_generate(model, tok, req, new),
                         lambda: kvdiff.record(model, tok, req, path, max_new_tokens=new, trace_mode="digest",
                                               fingerprint=fingerprint), "<= 1.1x", remove_trace)
            row.name = (f"reference: digest capture on vs off, {n} + {new} tokens, "
                        f"trace {os.path.getsize(path) / 1e6:.1f} MB, s")
            rows.append(row)
        if "engine" in DIGEST_PATHS["paths"]:
            row = paired(setup, "", lambda: engine_run(req, new), lambda: engine_run(req, new, path), "<= 1.1x",
                         remove_trace)
            row.name = f"engine: digest capture on vs off, {n} + {new} tokens, trace {os.path.getsize(path) / 1e6:.1f} MB, s"
            rows.append(row)
        remove_trace()
    return rows


def bench_scale(setup: Setup) -> list[Row]:
    """`kvdiff.compare` end to end (digest capture, zoom) on a SCALE["tokens"]-token prompt, isolated-local
    so that there is a divergence to find: wall time, time to the first divergence, peak GPU memory."""
    model, tok = setup.model, setup.tok
    words = " ".join(f"Clause {i}: the assistant keeps every answer short, exact and kind." for i in range(2400))
    ids = tok(words, add_special_tokens=False)["input_ids"][:SCALE["tokens"] - 64]
    messages = conv(tok.decode(ids), "What is the capital of France?")
    n = len(render_prompt_ids(tok, messages))
    name = f"random:{model.config.hidden_size}"
    cache = {ModelKey(name, "bfloat16", "cuda"): (model, tok)}
    marks: dict[str, float] = {}
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    result = kvdiff.compare(messages, model=name, dtype="bfloat16", device="cuda", strategy="isolated-local",
                            numerics="fast", max_new_tokens=8, model_cache=cache,
                            out=os.path.join(setup.trace_dir, f"scale-{n}"),
                            progress=lambda what: marks.setdefault(what.split(":")[0], time.perf_counter()))
    total = time.perf_counter() - start
    first = marks.get("zooming in", start + total) - start
    peak = torch.cuda.max_memory_allocated() / 2**30
    where = result.report.first("first_bit_difference") or {}
    sizes = result.report.section("digest").get("trace_bytes", {})
    return [Row(f"compare, {n}-token prompt, isolated-local: first bit difference at layer {where.get('layer')} "
                f"position {where.get('position')} after (s) / whole run (s)", first, total, total / first, "context"),
            Row(f"  peak GPU memory GB (model {sum(p.numel() for p in model.parameters()) * 2 / 2**30:.1f} GB) / "
                f"trace MB (first pass, zoom)", peak, sum(sizes.values()) / 1e6, 0.0, "recorded")]


def disk_write_time(folder: str, nbytes: int) -> float:
    """Best time to write `nbytes` from host memory into a new file in `folder`, in 1 MB pieces
    as the trace writer does: what writing a trace costs before any capture, copy or HDF5 work."""
    data = memoryview(bytearray(b"\x07") * nbytes)
    path, piece, best = os.path.join(folder, "disk-floor.bin"), 1 << 20, float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            for at in range(0, nbytes, piece):
                os.pwrite(fd, data[at:at + piece], at)
        finally:
            os.close(fd)
        best = min(best, time.perf_counter() - start)
        os.remove(path)        # untimed, as between the capture runs
    return best


def warm_ttft(model, tok, system: str, hit_turns: tuple[str, ...] = ("Name a colour.",),
              kv_budget_bytes: int | None = None) -> tuple[float, float]:
    """A warm engine's time to first token (kernels compiled, the hit's graph captured: a
    server's steady state): of `system` with a new question, its cold prefill, and the median of
    its cache hits, `system` with each of `hit_turns`."""
    eng = Engine(model, tok, strategy="prefix", kv_budget_bytes=kv_budget_bytes)
    for user in ("Hi", "Name a colour."):    # the second's new turn is a measured hit's: its graph
        eng.generate([conv("Warm up.", user)], max_new_tokens=1)
    cold = eng.generate([conv(system, "What is the capital of France?")], max_new_tokens=1)[0].stats.ttft_s
    hits = []
    for user in hit_turns:
        torch.cuda.synchronize()
        hits.append(eng.generate([conv(system, user)], max_new_tokens=1)[0].stats.ttft_s)
    return cold, statistics.median(hits)


def bench_ttft(setup: Setup) -> list[Row]:
    """A cache hit's time to first token against the same prompt's cold prefill, on an engine
    whose kernels and graphs are warm (a server's steady state)."""
    model, tok = setup.model, setup.tok
    rows = []
    for system in (SYSTEM_2K, SYSTEM_8K):
        n_sys = len(render_prompt_ids(tok, conv(system, "Hi")))
        # Throwaway engines: one at another length compiles the process's kernels, one at this
        # length times a prompt of a length the process has not run (what a new request meets).
        Engine(model, tok, strategy="prefix", kv_budget_bytes=2**31).generate([conv(system[:-80], "Hi")],
                                                                              max_new_tokens=1)
        first = Engine(model, tok, strategy="prefix", kv_budget_bytes=2**31).generate(
            [conv(system, "What is the capital of France?")], max_new_tokens=1)[0].stats.ttft_s
        cold, warm = warm_ttft(model, tok, system)
        gc.collect()          # engines hold their KV pools in reference cycles
        rows.append(Row(f"TTFT, cached {n_sys}-token chunk vs no reuse, s", cold, warm, cold / warm,
                        "speed-up (>= 20x on 8B, >= 5x on 1B at ~2.5k)"))
        rows.append(Row("  no reuse: that prompt's length again vs the first prompt of its length, s", cold,
                        first, first / cold, "close to 1x (no per-shape cost)"))
    return rows


def memory_floor_s(model) -> float:
    """The memory-bandwidth floor of a batch-1 decode step: the weights' bytes over the rate of a
    large device-to-device copy (which reads and writes each byte)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy = min(timed(lambda: dst.copy_(src)) for _ in range(5))
    return weights / (2 * src.numel() / copy)


def bench_decode(setup: Setup) -> list[Row]:
    model, tok = setup.model, setup.tok
    one = [conv("You are a helpful assistant.", "Write a long story about a dragon.")]
    many = [conv("You are a helpful assistant.", f"Story {i}: write about a dragon named {i}.") for i in range(BATCH)]
    # One engine per side, as a server keeps one: its decode graphs are captured once.
    graphed, eager = Engine(model, tok), Engine(model, tok, cuda_graphs=False)
    hf_1 = decode_rate(lambda n: hf_generate(model, tok, one[0], n), 1)
    eager_1 = decode_rate(lambda n: eager.generate(one, max_new_tokens=n), 1)
    eng_1 = decode_rate(lambda n: graphed.generate(one, max_new_tokens=n), 1)
    hf_32 = decode_rate(lambda n: hf_batch_generate(model, tok, many, n), BATCH)
    eng_32 = decode_rate(lambda n: graphed.generate(many, max_new_tokens=n), BATCH)
    floor = memory_floor_s(model)
    return [Row("decode tokens/s, batch 1: generate vs engine", hf_1, eng_1, eng_1 / hf_1, ">= 4x"),
            Row(f"decode tokens/s, batch {BATCH}: generate vs engine", hf_32, eng_32, eng_32 / hf_32, ">= 4x"),
            Row("decode tokens/s, batch 1: engine without vs with CUDA graphs", eager_1, eng_1, eng_1 / eager_1,
                "speed-up"),
            Row("decode step, batch 1: memory floor vs engine, ms", floor * 1e3, 1e3 / eng_1,
                floor * eng_1, ">= 0.7 of the floor"),
            Row(f"decode tokens/s, generate batch 1 vs engine batch {BATCH}", hf_1, eng_32, eng_32 / hf_1, "report")]


def print_rows(title: str, rows: list[Row]) -> None:
    """One shape's table."""
    print(f"\n{title}")
    print(f"  {'benchmark':84} {'baseline':>10} {'kvdiff':>10} {'ratio':>8} {'pairs':>13}  goal")
    for row in rows:
        spread = f"{row.spread[0]:.2f}-{row.spread[1]:.2f}x" if row.spread else ""
        print(f"  {row.name:84} {row.baseline:10.4f} {row.kvdiff:10.4f} {row.ratio:7.2f}x {spread:>13}  {row.goal}")
    sys.stdout.flush()          # each shape's table as it is done: a run cut short keeps the shapes before


BENCHMARKS = {"numerics": bench_numerics, "capture": bench_capture, "digest": bench_digest, "scale": bench_scale,
              "ttft": bench_ttft, "decode": bench_decode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default=".gpu/tokenizer", help="folder of the default model's tokenizer")
    parser.add_argument("--shape", nargs="+", default=list(DEFAULT_SHAPES), choices=list(REAL_SHAPES),
                        help=f"model shapes (default {' '.join(DEFAULT_SHAPES)}; also llama-3.1-8b)")
    parser.add_argument("--only", nargs="+", default=list(BENCHMARKS), choices=list(BENCHMARKS),
                        help="run only these benchmarks")
    parser.add_argument("--pairs", type=int, default=PAIRS, help="alternated pairs per numerics and capture row")
    parser.add_argument("--scale-tokens", type=int, default=SCALE["tokens"], help="the scale benchmark's prompt length")
    parser.add_argument("--digest-paths", nargs="+", default=list(DIGEST_PATHS["paths"]), choices=["reference", "engine"],
                        help="the digest benchmark's sides (the 8B reference rows take minutes)")
    args = parser.parse_args()
    SCALE["tokens"] = args.scale_tokens
    DIGEST_PATHS["paths"] = tuple(args.digest_paths)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    if not torch.cuda.is_available():
        print("bench_gpu: skipped, it needs a CUDA GPU (docs/gpu.md runs it through the device tool)", file=sys.stderr)
        sys.exit(BENCHMARK_SKIPPED)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, bfloat16")
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVDIFF_BENCH_DIR")) as trace_dir:
        for shape in args.shape:
            model, tok = random_model(shape, args.tokenizer, dtype="bfloat16", device="cuda")
            setup = Setup(model, tok, trace_dir, args.pairs)
            rows = [row for name in args.only for row in BENCHMARKS[name](setup)]
            del setup, model
            gc.collect()          # engines hold their KV pools in reference cycles (pool <-> registry)
            torch.cuda.empty_cache()
            print_rows(shape, rows)


if __name__ == "__main__":
    main()

"""Digest capture: its cost against the same run unprobed, and its trace against a full one.

    python benchmarks/bench_digest.py [--model smollm2-135m] [--prompt-tokens 2000] [--pairs 3]
    python benchmarks/bench_digest.py --scale 8000      # kvdiff compare end to end on an 8,000-token prompt
    python benchmarks/bench_digest.py --host-bound [--pairs 5]    # the host's cost per capture (tiny model)
    python benchmarks/bench_digest.py --sizes           # the trace sizes alone

Two requests of the reference path (transformers, greedy): prompt-heavy (`--prompt-tokens`
prompt tokens, 4 generated) and decode-heavy (200 prompt tokens, `--decode-tokens` generated).
Each is run unprobed and with digest capture (`kvdiff.record(trace_mode="digest")`: every row
of every point, layer and position hashed, the trace written and closed), in alternated pairs;
the figure is the median of the pairs' ratios. The size row compares the full trace of the
prompt-heavy request with its zoom trace (digests plus a window of 3 layers x 64 positions in
full, as `compare` writes by default where the first difference is past layer 0), and the same
window keeping k and v at every earlier position of its layers too (its keys, as `compare`'s
window does where the first difference is attention's output past where the window starts).
`--sizes` measures the sizes alone. `--scale N` instead runs `kvdiff.compare` (digest
capture, isolated-local, so that there is a divergence to find) on an N-token prompt and prints
the time to the first difference (the digest diff's end), the whole run's and its peak memory.
`--host-bound` instead times a 30-layer tiny model (kvdiff/engine/tiny.py, width 64), whose
compute is negligible, so that its runs are bound by Python as a GPU's are: 33 prompt tokens +
128 generated, the reference path and kvdiff's engine, each digest-captured against the same run
unprobed in alternated pairs; besides the ratio, the difference of the medians per capture, in us,
and that of a 1-token request (what a trace costs whatever its length: opening, the prompt's
forward, closing).
"""

from __future__ import annotations

import argparse
import logging
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch

import kvdiff
from kvdiff.conversation import render_prompt_ids
from kvdiff.engine import Engine
from kvdiff.engine.reference import reference_generate
from kvdiff.engine.tiny import build_tiny_model
from kvdiff.probes.hooks import attach_probes
from kvdiff.probes.recorder import TraceRecorder
from kvdiff.trace.fingerprint import model_fingerprint

log = logging.getLogger("bench_digest")
TEXT = ("You are a helpful assistant. Always answer in French. What is the capital of France? "
        "Chunked prefill reuses the key and value cache of a system prompt across requests. ")


def messages_of(tokenizer, n_tokens: int) -> list[dict]:
    """A user message whose rendered prompt has about `n_tokens` tokens."""
    words = TEXT.split()
    text = " ".join(words[i % len(words)] for i in range(n_tokens))
    while len(render_prompt_ids(tokenizer, [{"role": "user", "content": text}])) > n_tokens:
        text = text.rsplit(" ", 8)[0]
    return [{"role": "user", "content": text}]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def ratio(model, tokenizer, messages, new_tokens: int, pairs: int, folder: Path, fingerprint: str,
          label: str) -> tuple[float, list]:
    """Median of `pairs` ratios (digest-captured / plain) and the raw (plain, digest) seconds."""
    runs = []
    for i in range(pairs):
        plain = timed(lambda: reference_generate(model, tokenizer, messages, new_tokens))
        digest = timed(lambda: kvdiff.record(model, tokenizer, messages, folder / f"{label}-{i}.h5",
                                             max_new_tokens=new_tokens,
                                             trace_mode="digest", fingerprint=fingerprint))
        runs.append((plain, digest))
    return statistics.median(d / p for p, d in runs), runs


def scale(model_name: str, n_tokens: int) -> None:
    """`kvdiff.compare` end to end on an `n_tokens`-token prompt: time to the first difference, total, peak RSS."""
    _, tokenizer = kvdiff.load_model(model_name)
    messages = messages_of(tokenizer, n_tokens - 16)
    messages.append({"role": "user", "content": "What is the capital of France?"})
    marks: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        result = kvdiff.compare(messages, model=model_name, strategy="isolated-local", max_new_tokens=4,
                                out=Path(folder) / "run",
                                progress=lambda what: marks.setdefault(what.split(":")[0], time.perf_counter()))
        total = time.perf_counter() - start
        report = result.report
        first = report.first("first_bit_difference") or {}
        sizes = report.section("digest").get("trace_bytes", {})
    log.info("compare, %d-token prompt, isolated-local: first bit difference (layer %s, position %s) known after "
             "%.1f s, whole run %.1f s (zoom: %s), traces %.1f MB, peak resident memory %.2f GB",
             len(report.prompt_tokens), first.get("layer"), first.get("position"),
             marks.get("zooming in", start + total) - start, total, report.section("digest").get("zoom"),
             sum(sizes.values()) / 1e6, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)


class Counted:
    """A sink that counts the captures it hands on to `sink` (those digested where they ran too)."""

    def __init__(self, sink):
        self.sink, self.captures = sink, 0

    def __getattr__(self, name: str):
        return getattr(self.sink, name)

    def capture(self, *args) -> None:
        self.captures += 1
        self.sink.capture(*args)

    def capture_norm(self, *args) -> None:
        self.captures += 1
        self.sink.capture_norm(*args)

    def take_digested(self, fired, *args) -> None:     # a forward's captures, digested where they ran
        self.captures += len(fired)
        self.sink.take_digested(fired, *args)


def host_bound(pairs: int, new_tokens: int = 128) -> None:
    """Digest capture on vs off on a tiny model: the host's cost per capture, the reference path and
    the engine; and what a trace costs whatever its length (the same with one new token)."""
    logging.getLogger("kvdiff").setLevel(logging.WARNING)      # not a line per trace written
    model, tokenizer = build_tiny_model("tiny-llama", num_layers=30)
    fingerprint = model_fingerprint(model)
    messages = messages_of(tokenizer, 40)
    engine = Engine(model, tokenizer, strategy="prefix")
    with tempfile.TemporaryDirectory() as name:
        path = Path(name) / "t.h5"

        def recorder(strategy: str, new: int) -> TraceRecorder:
            return TraceRecorder.for_model(model, tokenizer, messages, path, strategy=strategy, fingerprint=fingerprint,
                                           max_new_tokens=new, trace_mode="digest")

        def reference(new: int, sink=None):
            if sink is None:
                return reference_generate(model, tokenizer, messages, new)
            with attach_probes(model, sink) as probes:
                out = reference_generate(model, tokenizer, messages, new, sink=probes)
            return sink.finish(out.token_ids, out.text)

        def engine_run(new: int, sink=None):
            (out,) = engine.generate([messages], max_new_tokens=new, sinks={} if sink is None else {0: sink})
            return None if sink is None else sink.finish(out.token_ids, out.text, out.chunks)

        def paired_runs(run, strategy: str, new: int) -> list[tuple[float, float]]:
            return [(timed(lambda: run(new)), timed(lambda: run(new, recorder(strategy, new)))) for _ in range(pairs)]

        n = len(render_prompt_ids(tokenizer, messages))
        for label, run, strategy in (("reference", reference, "reference"), ("engine (prefix)", engine_run, "prefix")):
            counted = Counted(recorder(strategy, new_tokens))
            run(new_tokens, counted)                               # warm-up, and the captures a run makes
            runs = paired_runs(run, strategy, new_tokens)
            plain, digest = statistics.median(p for p, _ in runs), statistics.median(d for _, d in runs)
            per_trace = statistics.median(d - p for p, d in paired_runs(run, strategy, 1))
            log.info("host-bound, %s, %d + %d tokens of a 30-layer tiny model, %d captures: digest capture %.2fx "
                     "unprobed (median of %d pairs, %.2f-%.2f; plain %.3f s, digest %.3f s): %.1f us a capture; "
                     "with 1 new token %.0f ms more than unprobed",
                     label, n, new_tokens, counted.captures, statistics.median(d / p for p, d in runs), len(runs),
                     min(d / p for p, d in runs), max(d / p for p, d in runs), plain, digest,
                     (digest - plain) / counted.captures * 1e6, per_trace * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--scale", type=int, default=None, help="run compare end to end on this many tokens")
    parser.add_argument("--host-bound", action="store_true", help="time a tiny model's digest capture instead")
    parser.add_argument("--sizes", action="store_true", help="measure the trace sizes alone")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.scale is not None:
        return scale(args.model, args.scale)
    if args.host_bound:
        return host_bound(args.pairs)

    model, tokenizer = kvdiff.load_model(args.model)
    fingerprint = model_fingerprint(model)
    heavy, light = messages_of(tokenizer, args.prompt_tokens), messages_of(tokenizer, 200)
    reference_generate(model, tokenizer, light, 2)           # warm-up
    log.info("model %s, torch %s, %d threads", args.model, torch.__version__, torch.get_num_threads())
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        if args.sizes:
            return sizes(model, tokenizer, heavy, folder, fingerprint)
        for label, messages, new in (("prompt-heavy", heavy, 4), ("decode-heavy", light, args.decode_tokens)):
            median, runs = ratio(model, tokenizer, messages, new, args.pairs, folder, fingerprint, label)
            n = len(render_prompt_ids(tokenizer, messages))
            log.info("%s (%d + %d tokens): digest capture %.3fx unprobed (median of %d pairs; plain %s s, digest %s s)",
                     label, n, new, median, len(runs), ", ".join(f"{p:.2f}" for p, _ in runs),
                     ", ".join(f"{d:.2f}" for _, d in runs))
        sizes(model, tokenizer, heavy, folder, fingerprint)


def sizes(model, tokenizer, messages: list[dict], folder: Path, fingerprint: str) -> None:
    """The prompt-heavy request's trace sizes: full, digests only, the default zoom window (3 layers
    x 64 positions past layer 0) and that window with its keys (k and v at every earlier position)."""
    n = len(render_prompt_ids(tokenizer, messages))
    window = dict(layers="9-11", positions=f"{n - 64}-{n - 1}")
    runs = {"full": {}, "digests": dict(trace_mode="digest"), "zoom": dict(trace_mode="digest", **window),
            "zoom with keys": dict(trace_mode="digest", key_positions=f"0-{n - 65}", **window)}
    size = {name: Path(kvdiff.record(model, tokenizer, messages, folder / f"{name}.h5", max_new_tokens=4,
                                     fingerprint=fingerprint, **args)).stat().st_size for name, args in runs.items()}
    log.info("trace size, prompt-heavy (%d + 4 tokens): full %.1f MB, digests only %.2f MB, zoom trace (digests + 3 "
             "layers x 64 positions) %.2f MB: %.0fx smaller than full; with the window's keys (k and v of its layers "
             "at positions 0-%d) %.2f MB: %.0fx", n, size["full"] / 1e6, size["digests"] / 1e6, size["zoom"] / 1e6,
             size["full"] / size["zoom"], n - 65, size["zoom with keys"] / 1e6, size["full"] / size["zoom with keys"])


if __name__ == "__main__":
    main()

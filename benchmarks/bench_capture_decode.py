"""Host cost of full capture per decode step: reference decode with and without every probe.

    python benchmarks/bench_capture_decode.py [--layers 30] [--steps 64] [--repeats 3]

A random Llama of the default model's depth (30 layers, 9/3 heads) but a width of 64 and the
default model's tokenizer: its kernels are so small that the host's work per step dominates,
as it does on a GPU for the real shapes (docs/benchmarks.md, "GPU"). The trace holds every
point of every layer and position. Each side runs 8 and 8 + `--steps` generated tokens, best
of `--repeats` alternated runs; the per-step cost is the difference over `--steps` steps, so
prefill and trace set-up drop out.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

import kvdiff
from kvdiff.engine.loading import converted_gguf_folder, default_gguf_path
from kvdiff.engine.reference import reference_generate
from shapes import shape_config

log = logging.getLogger("bench_capture_decode")
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Tell me a long story."}]
FIRST = 8


def narrow_model(layers: int):
    """The default model's shape at a width of 64, seeded; its tokenizer from the bundled model."""
    config = shape_config("smollm2-135m")
    config.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, head_dim=16,
                       eos_token_id=None))
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.kvdiff_source = f"random:narrow-{layers}:seed0"
    tokenizer = AutoTokenizer.from_pretrained(str(converted_gguf_folder(default_gguf_path())))
    return model, tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("kvdiff").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    model, tokenizer = narrow_model(args.layers)
    folder = tempfile.mkdtemp()
    path = os.path.join(folder, "t.h5")

    def off(n: int) -> None:
        if len(reference_generate(model, tokenizer, MESSAGES, n).token_ids) != n:
            raise SystemExit(f"the model stopped before {n} tokens: pick another --layers")

    def on(n: int) -> None:
        kvdiff.record(model, tokenizer, MESSAGES, path, max_new_tokens=n)
        os.remove(path)

    lengths = (FIRST, FIRST + args.steps)
    best = {(side, n): float("inf") for side in ("off", "on") for n in lengths}
    off(4), on(4)
    for _ in range(args.repeats):
        for side, run in (("off", off), ("on", on)):
            for n in lengths:
                start = time.perf_counter()
                run(n)
                best[side, n] = min(best[side, n], time.perf_counter() - start)
    step = {side: (best[side, lengths[1]] - best[side, lengths[0]]) / args.steps * 1e3 for side in ("off", "on")}
    log.info("%d layers, width 64, torch %s, 1 thread; best of %d", args.layers, torch.__version__, args.repeats)
    log.info("decode step without capture  %.2f ms", step["off"])
    log.info("decode step with capture     %.2f ms  (+%.2f ms, %.2fx)", step["on"], step["on"] - step["off"],
             step["on"] / step["off"])
    log.info("%d generated tokens           %.2f s vs %.2f s (%.2fx, trace set-up and close included)",
             lengths[1], best["off", lengths[1]], best["on", lengths[1]], best["on", lengths[1]] / best["off", lengths[1]])
    os.rmdir(folder)


if __name__ == "__main__":
    main()

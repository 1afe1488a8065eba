"""GPU check of the windowed families at their mid-size shapes (issue #31): `prefix` in exact numerics
is bitwise identical to the reference in bfloat16 on a conversation past the sliding window, cold
and with the system chunk cached by another conversation, and isolated-local leads with
position_mismatch. Gemma 3 (32M) and gpt-oss (108M) of `bench_families.py`, both with a
128-position window, and a prompt of about 340 tokens.

    python benchmarks/gpu_windowed_families.py        # exits 1 if a check fails
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bench_families import SHAPES, build  # noqa: E402
from kvdiff.conversation import render_prompt_ids  # noqa: E402
from kvdiff.run.compare import compare  # noqa: E402
from kvdiff.run.model_cache import ModelKey  # noqa: E402

WINDOW = 128
SYSTEM = "You are a helpful assistant. Always answer in French."
LONG = [{"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the capital of France? " + "The quick brown fox jumps over the lazy dog. " * 30}]
OTHER = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "La capitale de la France est Paris."}]


def check(family: str) -> bool:
    """Print each run's outcome; True when all three checks hold."""
    SHAPES[family][1]["sliding_window"] = WINDOW      # set before the model is built: its layers keep their own copy
    model, tok, params = build(family)
    model = model.to("cuda", torch.bfloat16)
    print(f"{family}: {params / 1e6:.0f}M parameters, window {WINDOW}, prompt {len(render_prompt_ids(tok, LONG))} tokens")
    cache = {ModelKey(family, "bfloat16", "cuda"): (model, tok)}
    ok = True
    for strategy, warm in (("prefix", OTHER), ("prefix", False), ("isolated-local", False)):
        result = compare(LONG, model=family, strategy=strategy, numerics="exact", warm=warm, max_new_tokens=8,
                         trace_mode="full", out=Path(tempfile.mkdtemp()) / "run", model_cache=cache,
                         device="cuda", dtype="bfloat16")
        report = result.report.to_json()
        top = report["diagnoses"][report["top_diagnosis"]]["kind"] if report.get("top_diagnosis") is not None else None
        print(f"  {strategy}, {'warm' if warm else 'cold'}: chunks {[c['cache'] for c in report['chunks']]}, exit "
              f"{result.exit_code}, first bit difference {report['first_bit_difference']}, top diagnosis {top}")
        ok &= (result.exit_code == 0 and report["first_bit_difference"] is None) if strategy == "prefix" \
            else top == "position_mismatch"
    return ok


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (docs/gpu.md)")
    results = [check(family) for family in ("gemma3", "gpt-oss")]
    print("all checks hold" if all(results) else "a check failed")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()

"""The first engine call of a process on a GPU: how much of it is compiling kvdiff's Triton kernels.

Run it twice: the first process compiles the kernels into Triton's cache (`~/.triton/cache`, or
`TRITON_CACHE_DIR`), the second loads them from there, so its first call costs only CUDA's and
cuBLAS's start. Prints the first and second call of each numerics (4 new tokens, 135M shape).

    python benchmarks/gpu_first_call.py --tokenizer .gpu/tokenizer
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from kvdiff.engine.engine import Engine  # noqa: E402
from shapes import random_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default=".gpu/tokenizer", help="folder of the default model's tokenizer")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (docs/gpu.md)")
    model, tok = random_model("smollm2-135m", args.tokenizer)
    request = [{"role": "user", "content": "Hello there, how are you?"}]
    for numerics in ("fast", "exact"):
        for call in ("first", "second"):
            start = time.perf_counter()
            Engine(model, tok, numerics=numerics).generate([request], max_new_tokens=4)
            torch.cuda.synchronize()
            print(f"process {os.getpid()}: {call} {numerics} call {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()

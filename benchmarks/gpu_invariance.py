"""Which GPU operations give a row the same bits whatever rows are computed with it?

Checks candidate implementations of the matmul, RMSNorm and attention on the current CUDA
device, in each dtype, on the default model's and Llama-3.2-1B's shapes, and times them on a
2,048-row input. Prints one line per (operation, dtype, shape): invariant or not, and ms.

    python benchmarks/gpu_invariance.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kvdiff.engine import gpu_kernels, numerics  # noqa: E402

SHAPES = {"smollm2": (576, 1536), "llama1b": (2048, 8192)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ROWS = 2048
SPLITS = [(0, 1), (5, 6), (0, 17), (100, 164), (37, 1000), (0, ROWS)]


def _tile_loop(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    rows = x.shape[0]
    tiles = numerics._pad_rows(x, 64)
    return torch.cat([tiles[i:i + 64] @ w_t for i in range(0, tiles.shape[0], 64)])[:rows]


def _batched_tiles(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    rows = x.shape[0]
    tiles = numerics._pad_rows(x, 64).view(-1, 64, x.shape[1])
    return torch.matmul(tiles, w_t).view(-1, w_t.shape[1])[:rows]


def _rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(x.shape[1]).to(x.device, x.dtype)
    norm.weight.data.copy_(w)
    return norm(x)


def _invariant(fn, x: torch.Tensor, *args) -> bool:
    whole = fn(x, *args)
    return all(torch.equal(fn(x[a:b].contiguous(), *args), whole[a:b]) for a, b in SPLITS)


def _ms(fn, *args) -> float:
    for _ in range(3):
        fn(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20


def main() -> None:
    dev = torch.device("cuda")
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}")
    matmuls = {"F.linear": lambda x, w_t: x @ w_t, "tile-loop-64": _tile_loop,
               "batched-tiles-64": _batched_tiles,
               "kvdiff.invariant_linear": lambda x, w_t: numerics.invariant_linear(x, w_t.t())}
    for shape, (hidden, inter) in SHAPES.items():
        for dname, dtype in DTYPES.items():
            x = torch.randn(ROWS, hidden, device=dev, dtype=dtype)
            w_t = (torch.randn(inter, hidden, device=dev, dtype=dtype) * hidden ** -0.5).t()
            for name, fn in matmuls.items():
                print(f"matmul {name:24s} {dname} {shape:8s} invariant={_invariant(fn, x, w_t)!s:5s} "
                      f"{_ms(fn, x, w_t):7.3f} ms")
            w = torch.rand(hidden, device=dev, dtype=dtype) + 0.5
            print(f"rmsnorm {'LlamaRMSNorm':23s} {dname} {shape:8s} invariant={_invariant(_rmsnorm, x, w)!s:5s} "
                  f"{_ms(_rmsnorm, x, w):7.3f} ms")
            triton_norm = lambda x, w: gpu_kernels.rms_norm(x, w, 1e-5)  # noqa: E731
            print(f"rmsnorm {'gpu_kernels.rms_norm':23s} {dname} {shape:8s} "
                  f"invariant={_invariant(triton_norm, x, w)!s:5s} {_ms(triton_norm, x, w):7.3f} ms")
            heads, kv_heads = hidden // 64, max(1, hidden // 64 // 3 if shape == "smollm2" else 8)
            q = torch.randn(ROWS, heads, 64, device=dev, dtype=dtype)
            k = torch.randn(ROWS, kv_heads, 64, device=dev, dtype=dtype)
            v = torch.randn(ROWS, kv_heads, 64, device=dev, dtype=dtype)
            causal = torch.ones(ROWS, ROWS, dtype=torch.bool, device=dev).tril()

            def attend(qq, k=k, v=v, start=0):
                rows = qq.shape[0]
                return numerics.exact_attention(qq, k, v, causal[start:start + rows], 0.125)

            whole = attend(q)
            same = all(torch.equal(attend(q[a:b].contiguous(), start=a), whole[a:b]) for a, b in SPLITS)
            print(f"attention {'exact_attention':21s} {dname} {shape:8s} invariant={same!s:5s} {_ms(attend, q):7.3f} ms")
            qh, kh, vh = q.transpose(0, 1), k.repeat_interleave(heads // kv_heads, 1).transpose(0, 1), \
                v.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
            sdpa = lambda qq: torch.nn.functional.scaled_dot_product_attention(qq, kh, vh, is_causal=True)  # noqa: E731
            print(f"attention {'SDPA causal (fast ref)':21s} {dname} {shape:8s} {'':15s} {_ms(sdpa, qh):7.3f} ms")


if __name__ == "__main__":
    main()

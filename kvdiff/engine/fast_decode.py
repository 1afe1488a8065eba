"""Fast numerics' own forwards: a decode step's few-row linears on the CPU, RMSNorm on CUDA.

On CUDA, transformers' RMSNorm is eight kernels (casts, square, mean, add, rsqrt, two
products); a decode step is bound by such small kernels as much as by the weights (on an 8B
model 65 norms a step), so fast numerics run it as exact numerics' one Triton kernel.

On the CPU, torch runs a one-row linear as a gemv, which on the 2-core AVX-512 CPU (torch 2.13, MKL) reads
a decode step's weights at about half the speed of a matmul of the row padded to two columns,
`weight @ [row, 0]^T` (30 ms against 14-15 ms for the default model's 211 linears, weights
out of cache). A few rows go the same way, weight first: `rows @ weight^T`, torch's form, is
1.5-3x slower up to 4 rows, and up to 64 rows its two threads share the work worse (16 rows: 63
against 48 ms a step on two threads; on one thread 10% faster than weight first, so kept there).
Fast numerics promise no bits, so the engine's fast forwards use these forms; more rows, and
weights off the CPU, keep the model's own linear.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Callable, Iterator

import torch
from torch import nn


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`nn.functional.linear(x, weight, bias)`, a few rows as a matmul of the weight with them
    (one row with a zero column)."""
    rows = x.numel() // x.shape[-1]
    if not _weight_first(rows) or x.is_cuda or x.dtype != weight.dtype:
        return nn.functional.linear(x, weight, bias)
    if rows == 1:
        out = (weight @ nn.functional.pad(x.reshape(1, -1), (0, 0, 0, 1)).t())[:, 0]
    else:
        out = (weight @ x.reshape(rows, x.shape[-1]).t()).t().contiguous()
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _weight_first(rows: int) -> bool:
    """Whether `row_linear` computes `rows` rows weight first (see the module's note)."""
    return rows <= 4 or (rows <= 64 and torch.get_num_threads() > 1)


def _forward(module: nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return row_linear(x, module.weight, module.bias)
    return forward


def fast_forwards(model: nn.Module) -> list[tuple[nn.Module, Callable]]:
    """(module, its fast forward) for every CPU nn.Linear of `model` (`row_linear`) and, where
    Triton runs, every CUDA RMSNorm of the Llama formula (`numerics.rms_norm_forward`)."""
    from kvdiff.engine.numerics import is_llama_rms_norm, rms_norm_forward

    out: list[tuple[nn.Module, Callable]] = []
    for m in model.modules():
        if isinstance(m, nn.Linear) and m.weight.device.type == "cpu":
            out.append((m, _forward(m)))
        elif is_llama_rms_norm(m) and m.weight.is_cuda and _triton():
            out.append((m, rms_norm_forward(m)))
    return out


def _triton() -> bool:
    return importlib.util.find_spec("triton") is not None


@contextlib.contextmanager
def fast_numerics(model: nn.Module, forwards: list[tuple[nn.Module, Callable]] | None = None) -> Iterator[nn.Module]:
    """Run `model`'s modules with fast numerics' own forwards inside the block (`forwards`:
    `fast_forwards(model)` where the caller keeps it); restored on exit."""
    if forwards is None:
        forwards = fast_forwards(model)
    patched = [(m, forward) for m, forward in forwards if "forward" not in m.__dict__]
    for m, forward in patched:     # what nn.Module.__setattr__ does with a plain attribute, without its checks
        m.__dict__["forward"] = forward
    try:
        yield model
    finally:
        for m, _ in patched:
            del m.__dict__["forward"]

"""Fast numerics' own forwards: linears on the CPU, RMSNorm on CUDA.

On CUDA, transformers' RMSNorm is eight kernels (casts, square, mean, add, rsqrt, two
products); a decode step is bound by such small kernels as much as by the weights (on an 8B
model 65 norms a step), so fast numerics run it as exact numerics' one Triton kernel.

On the CPU, torch runs a linear through MKL, which on the 2-core AMD EPYC VM (AVX-512, torch 2.13)
reaches about half the machine's float32 peak, and runs one row as a gemv at about half the
speed of a matmul of the row padded to two columns. Fast numerics promise no bits, so the
engine's fast forwards compute a linear of 2 to 4 rows weight first (`weight @ rows^T`; one row
with a zero column), 1.5-3x faster than torch's form, and more rows through oneDNN's inner
product (float32) on its packed copy of the weight (`cpu_linear.PACKED`): the default model's 211
linears take 29 against 54 ms at 16 rows and 0.65 against 1.24 s at 949 rows, on two threads as
on one, unpacked; packed, a few-row prefill (a cache hit's new turn, a batch's decode step) takes
another 20-30% less on an AVX2 CPU. Weights off the CPU keep the model's own linear.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Callable, Iterator

import torch
from torch import nn

from kvdiff.engine.cpu_linear import ONEDNN, PACKED
from kvdiff.engine.numerics import is_llama_rms_norm, rms_norm_forward, swapped_forwards


def fast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`nn.functional.linear(x, weight, bias)` in the CPU's fastest form for its number of rows."""
    rows = x.numel() // x.shape[-1]
    if x.is_cuda or x.dtype != weight.dtype:
        return nn.functional.linear(x, weight, bias)
    if rows > 4:
        if ONEDNN and x.dtype == torch.float32:
            out = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), PACKED.of(weight), bias,
                                                     "none", [], "")
            return out.view(*x.shape[:-1], weight.shape[0])
        return nn.functional.linear(x, weight, bias)
    if rows == 1:
        out = (weight @ nn.functional.pad(x.reshape(1, -1), (0, 0, 0, 1)).t())[:, 0]
    else:
        out = (weight @ x.reshape(rows, x.shape[-1]).t()).t().contiguous()
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _forward(module: nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return fast_linear(x, module.weight, module.bias)
    return forward


def fast_forwards(model: nn.Module) -> list[tuple[nn.Module, Callable]]:
    """(module, its fast forward) for every CPU nn.Linear of `model` (`fast_linear`) and, where
    Triton runs, every CUDA RMSNorm of the Llama formula (`numerics.rms_norm_forward`)."""
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
    # a module whose forward is already replaced (a wrapper, exact numerics) keeps it
    with swapped_forwards([(m, forward) for m, forward in forwards if "forward" not in m.__dict__]):
        yield model

"""Exact (batch-invariant) numerics: every row gets the same bits whatever rows it is computed with.

Two pieces, shared by the engine and, through `exact_numerics(model)`, by the reference model:

- `invariant_linear` (kvdiff/engine/invariant_linear.py): rows are padded to fixed-size row
  tiles and every tile is multiplied with the same shape, so a row's bits depend neither on how
  many rows come with it nor on where in its tile it sits. On CUDA one matmul per 64-row tile in fp32, one batched matmul of
  64-row tiles in bf16/fp16 (cuBLAS's batched fp32 form is not row-invariant:
  benchmarks/gpu_invariance.py measures each GPU form); on the CPU, batched 16-row tiles or, for
  a decode step's few rows, one 4-row matmul checked to give the same bits
  (kvdiff/engine/cpu_linear.py; tests/test_engine_units.py).
- `exact_attention`: keys are processed in fixed 64-key tiles aligned to sequence position 0,
  with an online softmax in tile order, so a query at position p reads the same tiles with the
  same reduction order whether it is computed in a prefill, a chunked prefill or a decode step
  (tiles past p are fully masked and leave the running state bit-for-bit unchanged;
  kvdiff/engine/exact_attention.py). On CUDA
  Triton kernels do the same walk, a 256-key segment of tiles at a time, the segments' states
  merged in position order, so that a decode row's segments run side by side
  (kvdiff/engine/gpu_kernels.py).
- RMSNorm on CUDA: torch's row reduction picks its strategy from the row count, so exact
  numerics run every RMSNorm module through a one-row-per-program Triton kernel.
- Mixture-of-experts layers: the router's linear and every expert's matmuls row-invariant
  (kvdiff/engine/exact_moe.py).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
from torch import nn

from kvdiff.engine.cpu_linear import PACKED, PackedWeights
from kvdiff.engine.exact_attention import exact_attention
from kvdiff.engine.exact_moe import moe_forwards
from kvdiff.engine.invariant_linear import invariant_linear
from kvdiff.errors import KvdiffError

log = logging.getLogger(__name__)


EXACT_ATTENTION = "kvdiff_exact"


def _exact_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-function signature around `exact_attention` (reference path)."""
    if attention_mask is None:
        raise KvdiffError("exact attention got no mask: register the kvdiff_exact mask function beside it")
    B, H, T, D = query.shape
    if scaling is None:
        scaling = D ** -0.5
    sinks = kwargs.get("s_aux")      # gpt-oss's attention sinks
    if B == 1:      # the reference path's one sequence: no per-row loop or stack
        mask = attention_mask[0, 0] if attention_mask.dim() == 4 else attention_mask[0]
        return exact_attention(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                               mask if mask.dtype == torch.bool else mask == 0, scaling, sinks).unsqueeze(0), None
    outs = []
    for b in range(B):
        mask = attention_mask[b, 0] if attention_mask.dim() == 4 else attention_mask[b]
        if mask.dtype != torch.bool:
            mask = mask == 0
        outs.append(exact_attention(query[b].transpose(0, 1), key[b].transpose(0, 1),
                                    value[b].transpose(0, 1), mask, scaling, sinks))
    return torch.stack(outs), None


def _exact_mask(*args, **kwargs):
    """Boolean causal mask, never skipped (a custom attention function must get a mask)."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    kwargs.pop("dtype", None)
    return sdpa_mask(*args, **kwargs)


def register_exact_attention() -> None:
    """Register kvdiff's exact attention and its mask function with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(EXACT_ATTENTION, _exact_attention_forward)
    AttentionMaskInterface.register(EXACT_ATTENTION, _exact_mask)


def _on(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`x` on `device`. This replaces accelerate's device hook too, where a split model placed
    one; checked here because a no-op `.to` still costs a device call per module and step."""
    return x if x.device == device else x.to(device)


def _linear_forward(module: nn.Linear, weight_first: bool, packed: PackedWeights):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(_on(x, module.weight.device), module.weight, module.bias, weight_first, packed)
    return forward


def rms_norm_forward(module: nn.Module):
    """`module`'s forward (a Llama-formula RMSNorm on CUDA) as one Triton kernel, a row per program."""
    from kvdiff.engine import gpu_kernels

    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))

    def forward(x: torch.Tensor) -> torch.Tensor:
        return gpu_kernels.rms_norm(_on(x, module.weight.device), module.weight, eps)
    return forward


def is_llama_rms_norm(module: nn.Module) -> bool:
    """Whether `module` is an RMSNorm of transformers' Llama formula (Llama, Mistral, Qwen2/3,
    gpt-oss, DeepSeek-V3; Gemma's scale by 1 + weight in float32: another formula)."""
    name = type(module).__name__
    return name.endswith("RMSNorm") and not name.startswith("Gemma")


def patched_forwards(model: nn.Module) -> list[tuple[nn.Module, object]]:
    """(module, exact forward) for every module exact numerics replace: all nn.Linear (the output
    embedding in cpu_linear's weight-first form on the CPU), on CUDA
    every RMSNorm (transformers' Llama/Mistral/Qwen2/Qwen3 norms share one formula), and the
    routers and experts of a mixture of experts."""
    out: list[tuple[nn.Module, object]] = moe_forwards(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for m in model.modules():
        if isinstance(m, nn.Linear):
            out.append((m, _linear_forward(m, m is head, PACKED)))
        elif is_llama_rms_norm(m) and m.weight.is_cuda:
            out.append((m, rms_norm_forward(m)))
    return out


@contextlib.contextmanager
def swapped_forwards(forwards: list[tuple[nn.Module, object]]) -> Iterator[None]:
    """Each (module, forward) pair's forward set on the module instance inside the block; what the
    instance had before (nothing, or a wrapper such as accelerate's) is put back on exit."""
    saved = [m.__dict__.get("forward") for m, _ in forwards]
    for m, forward in forwards:      # what nn.Module.__setattr__ does with a plain attribute, without its checks
        m.__dict__["forward"] = forward
    try:
        yield
    finally:
        for (m, _), before in zip(forwards, saved):
            if before is None:
                del m.__dict__["forward"]
            else:
                m.__dict__["forward"] = before


@contextlib.contextmanager
def exact_numerics(model: nn.Module, forwards: list[tuple[nn.Module, object]] | None = None,
                   attention: bool = True) -> Iterator[nn.Module]:
    """Run `model` with batch-invariant numerics inside the block; everything is restored on exit.

    Patches every nn.Linear's (and on CUDA every RMSNorm's) forward on the instance (`forwards`:
    `patched_forwards(model)` where the caller keeps it), and switches the model's attention to
    kvdiff's exact attention (with its mask function) unless `attention` is False (a caller that
    runs attention itself, as the engine does: transformers' set_attn_implementation walks every
    module, twice a call). Re-entrant: a use nested in one that switched attention is a no-op.
    """
    if getattr(model, "_kvdiff_exact_depth", 0):
        model._kvdiff_exact_depth += 1
        try:
            yield model
        finally:
            model._kvdiff_exact_depth -= 1
        return
    patched = patched_forwards(model) if forwards is None else forwards
    previous = model.config._attn_implementation
    with swapped_forwards(patched):
        if attention:
            register_exact_attention()
            model.set_attn_implementation(EXACT_ATTENTION)
            model._kvdiff_exact_depth = 1
        log.debug("exact numerics on for %d modules", len(patched))
        try:
            yield model
        finally:
            if attention:
                model._kvdiff_exact_depth = 0
                model.set_attn_implementation(previous)

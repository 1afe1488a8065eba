"""Row-invariant linear layers: a row's bits do not depend on how many rows are computed with it
(the first piece of exact numerics, `numerics.py`)."""

from __future__ import annotations

import torch
from torch import nn

from kvdiff.engine.cpu_linear import PackedWeights, cpu_invariant_matmul, pad_rows
from kvdiff.engine.row_tiles import CUDA_ROW_TILE, row_tiles


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     weight_first: bool = False, packed: PackedWeights | None = None) -> torch.Tensor:
    """`nn.functional.linear` whose row results do not depend on the number of rows (the bias
    is added separately); `weight_first`: on the CPU, cpu_linear's form for a weight that sees a
    row or two a forward (the LM head); `packed`: on the CPU, where packed weights are kept."""
    if x.is_cuda and x.dtype != torch.float32 and x.dim() >= 2 and x.numel() == x.shape[-1]:
        # One row (a decode step): its 64-row tile is the row and 63 others, repeated or spare
        # (row_tiles.py): a row's bits do not depend on the other rows of its tile.
        out = nn.functional.linear(row_tiles(x, CUDA_ROW_TILE), weight)[..., :1, :]
        return out if bias is None else out + bias
    flat = x.reshape(-1, x.shape[-1])
    if not flat.is_cuda:
        out = cpu_invariant_matmul(flat, weight, weight_first, packed)
    elif flat.dtype != torch.float32:      # one matmul of whole 64-row tiles
        out = nn.functional.linear(row_tiles(x, CUDA_ROW_TILE), weight)[:flat.shape[0]]
    else:        # float32 on a GPU: a matmul per tile (the batched form was not invariant there)
        weight_t = weight.t()
        out = torch.cat([part @ weight_t for part in pad_rows(flat, CUDA_ROW_TILE).split(CUDA_ROW_TILE)])
        out = out[:flat.shape[0]]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])

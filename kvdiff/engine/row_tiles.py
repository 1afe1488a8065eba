"""A linear layer's input as whole row tiles, kept for the next projection of the same input.

Exact numerics multiply whole 64-row tiles on CUDA (invariant_linear.py), so the input is
copied into tiles first: a decode step's one row repeated to a tile, a prefill's rows
zero-padded to a multiple of 64. q, k and v (gate and up) read one input, and each copy is a
kernel of its own, a decode step's most frequent one; the last input's tiles are therefore kept
while that input lives and reused for it. Where kvdiff's own kernels make a linear's input (exact
RMSNorm, exact attention), they write it into rows with spare rows after them up to whole tiles
(`with_spare_rows`), and the linear reads those tiles in place: a row's bits depend on no other
row of its tile, so what the spare rows hold does not matter.
"""

from __future__ import annotations

import weakref

import torch

from kvdiff.engine.cpu_linear import pad_rows

CUDA_ROW_TILE = 64     # CUDA: fixed row tiles, one batched matmul (bf16/fp16) or one per tile (fp32)
_last: tuple[weakref.ref, int | None, int, torch.Tensor] | None = None    # (input, its version, tile, its tiles)


def _forget(ref: weakref.ref) -> None:
    global _last
    if _last is not None and _last[0] is ref:
        _last = None


def with_spare_rows(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, tile: int) -> torch.Tensor:
    """An empty contiguous tensor of `shape` (rows first) whose storage goes on with spare rows up
    to a whole number of `tile`-row tiles, so that `row_tiles` of it (or of a contiguous view of
    it) needs no copy."""
    rows = shape[0]
    return torch.empty((-(-max(rows, 1) // tile) * tile, *shape[1:]), dtype=dtype, device=device)[:rows]


def _in_place(x: torch.Tensor, tile: int) -> torch.Tensor | None:
    """`x`'s tiles read in place where x is contiguous and its storage goes on far enough past it
    (as `with_spare_rows` makes it), else None. The rows past x belong to x's storage; what they
    hold does not change x's rows."""
    if not x.is_contiguous():
        return None
    width = x.shape[-1]
    rows = x.numel() // width
    whole = -(-max(rows, 1) // tile) * tile
    if x.untyped_storage().nbytes() // x.element_size() - x.storage_offset() < whole * width:
        return None
    tiles = x.as_strided((whole, width), (width, 1))
    return tiles.view(*x.shape[:-2], tile, width) if rows == 1 else tiles


def row_tiles(x: torch.Tensor, tile: int) -> torch.Tensor:
    """The rows of `x` (..., width) as whole `tile`-row tiles: one row repeated to a tile,
    (..., tile, width); more rows zero-padded, (rows rounded up to tiles, width); read in place
    where x's storage has room for its tiles (`with_spare_rows`). The same
    object at the same version holds the same rows. An inference tensor has no version: nothing
    changes a layer's input in place between the projections that read it."""
    global _last
    version = None if x.is_inference() else x._version
    last = _last
    if last is not None and last[0]() is x and last[1:3] == (version, tile):
        return last[3]
    tiles = _in_place(x, tile)
    if tiles is None and x.numel() == x.shape[-1]:
        tiles = x.expand(*x.shape[:-2], tile, x.shape[-1]).contiguous()
    elif tiles is None:
        tiles = pad_rows(x.reshape(-1, x.shape[-1]), tile)
    _last = (weakref.ref(x, _forget), version, tile, tiles)
    return tiles

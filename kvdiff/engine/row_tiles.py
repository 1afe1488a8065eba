"""A linear layer's input as whole row tiles, kept for the next projection of the same input.

Exact numerics multiply whole 64-row tiles on CUDA (numerics.invariant_linear), so the input is
copied into tiles first: a decode step's one row repeated to a tile, a prefill's rows
zero-padded to a multiple of 64. q, k and v (gate and up) read one input, and each copy is a
kernel of its own, a decode step's most frequent one; the last input's tiles are therefore kept
while that input lives and reused for it.
"""

from __future__ import annotations

import weakref

import torch

from kvdiff.engine.cpu_linear import pad_rows

_last: tuple[weakref.ref, int | None, int, torch.Tensor] | None = None    # (input, its version, tile, its tiles)


def _forget(ref: weakref.ref) -> None:
    global _last
    if _last is not None and _last[0] is ref:
        _last = None


def row_tiles(x: torch.Tensor, tile: int) -> torch.Tensor:
    """The rows of `x` (..., width) as whole `tile`-row tiles: one row repeated to a tile,
    (..., tile, width); more rows zero-padded, (rows rounded up to tiles, width). The same
    object at the same version holds the same rows. An inference tensor has no version: nothing
    changes a layer's input in place between the projections that read it."""
    global _last
    version = None if x.is_inference() else x._version
    last = _last
    if last is not None and last[0]() is x and last[1:3] == (version, tile):
        return last[3]
    if x.numel() == x.shape[-1]:
        tiles = x.expand(*x.shape[:-2], tile, x.shape[-1]).contiguous()
    else:
        tiles = pad_rows(x.reshape(-1, x.shape[-1]), tile)
    _last = (weakref.ref(x, _forget), version, tile, tiles)
    return tiles

"""Paged KV cache: a preallocated pool of fixed-size blocks per layer, addressed by slot.

A slot is `block * block_size + offset`. A chunk's KV lives in blocks owned by its registry
entry and is shared by every request that reuses it; a request's own tokens (its final chunk
under non-prefix strategies, re-rotated copies, decode tokens) live in its own blocks. A
request's block table lists its segments in sequence order, so position p maps to one slot
even when chunk boundaries do not fall on block boundaries.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from kvdiff.errors import KvdiffError

log = logging.getLogger(__name__)

BLOCK_SIZE = 16


class OutOfBlocks(KvdiffError):
    """The block pool has too few free blocks."""


class BlockPool:
    """Per-layer K and V pools of `num_blocks` blocks of `block_size` tokens.

    Slot tensors live on `device`; each layer's pool lives on its layer's device
    (`layer_devices`, for a model split across GPUs; default `device` for all). A V row is
    (num_kv_heads, head_dim) unless `value_shape` says otherwise (latent_cache.LatentPool's).
    """

    holds_kv = True       # attention reads the K and V rows as stored (the paged kernel reads the pools)

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 dtype: torch.dtype, device: torch.device, block_size: int = BLOCK_SIZE,
                 layer_devices: list[torch.device] | None = None, value_shape: tuple[int, ...] | None = None):
        if num_blocks < 1:
            raise KvdiffError("the KV budget holds no block: raise kv_budget_bytes")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.value_dim = head_dim          # the width of a head's value as attention reads it
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        where = layer_devices or [device] * num_layers
        self.k = [torch.empty(shape, dtype=dtype, device=where[i]) for i in range(num_layers)]
        v_shape = shape if value_shape is None else (shape[0], *value_shape)
        self.v = [torch.empty(v_shape, dtype=dtype, device=where[i]) for i in range(num_layers)]
        self._free = list(range(num_blocks - 1, -1, -1))
        self.device = device
        # Called with the number of blocks missing before giving up (the registry evicts here).
        self.reclaim: Callable[[int], None] = lambda missing: None

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        block_size: int = BLOCK_SIZE) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks, reclaiming cached ones if short; OutOfBlocks if impossible."""
        if num_blocks > len(self._free):
            self.reclaim(num_blocks - len(self._free))
        if num_blocks > len(self._free):
            raise OutOfBlocks(f"KV cache full: need {num_blocks} blocks, {len(self._free)} free; raise kv_budget_bytes")
        return [self._free.pop() for _ in range(num_blocks)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def slots(self, blocks: list[int], num_tokens: int, first: int = 0) -> torch.Tensor:
        """Slots of tokens first..first+num_tokens-1 stored in `blocks` (in order)."""
        return torch.from_numpy(self.host_slots(blocks, num_tokens, first)).to(self.device)

    def host_slots(self, blocks: list[int], num_tokens: int, first: int = 0) -> np.ndarray:
        """`slots(...)` as a host int64 array."""
        idx = np.arange(first, first + num_tokens, dtype=np.int64)
        table = np.asarray(blocks, dtype=np.int64)
        return table[idx // self.block_size] * self.block_size + idx % self.block_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        pool_k, pool_v = self.k[layer], self.v[layer]
        pool_k.index_copy_(0, _like(slots, pool_k.device), _like(k, pool_k.device, pool_k.dtype))
        pool_v.index_copy_(0, _like(slots, pool_v.device), _like(v, pool_v.device, pool_v.dtype))

    def read(self, layer: int, slots: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows at `slots` as attention reads them, on the layer's device."""
        return self.rows(layer, slots)

    def rows(self, layer: int, slots: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        """The two rows the cache holds at `slots` (here K and V), on the layer's device; a slice
        of consecutive slots (`slot_run`) reads them as views of the pool, without a copy."""
        if isinstance(slots, slice):
            return self.k[layer][slots], self.v[layer][slots]
        slots = _like(slots, self.k[layer].device)
        return self.k[layer].index_select(0, slots), self.v[layer].index_select(0, slots)


def slot_run(slots: torch.Tensor | np.ndarray) -> slice | None:
    """`slots` as a slice where they are consecutive and on the host (a CPU tensor or an array),
    else None: on the CPU a cached chunk's keys are then read in place, not gathered each layer
    (2,445 keys of the default model: ~0.25 ms a layer). A device's slots are not read back."""
    if isinstance(slots, torch.Tensor):
        if slots.device.type != "cpu":
            return None
        slots = slots.numpy()
    n = slots.shape[0]
    if n and slots[-1] - slots[0] == n - 1 and (n == 1 or bool((np.diff(slots) == 1).all())):
        return slice(int(slots[0]), int(slots[-1]) + 1)
    return None


def _like(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` on `device` (and in `dtype`); checked here because a no-op `.to` still costs a dispatch
    per layer and step."""
    if t.device == device and (dtype is None or t.dtype == dtype):
        return t
    return t.to(device, dtype)


@dataclass
class Segment:
    """A run of a request's sequence positions and the slots holding their KV."""

    start: int                    # first sequence position
    slots: torch.Tensor           # (n,) long
    shared_key: str | None        # registry key when the slots belong to a shared entry

    @property
    def end(self) -> int:
        return self.start + int(self.slots.shape[0])


@dataclass
class BlockTable:
    """A request's view of its KV: segments in sequence order, and the blocks it owns."""

    pool: BlockPool
    segments: list[Segment] = field(default_factory=list)
    own_blocks: list[int] = field(default_factory=list)
    own_tokens: int = 0
    scratch_blocks: list[int] = field(default_factory=list)
    _host: np.ndarray | None = None   # all_slots() on the host, kept up to date by add_own and add_shared

    def host_slots(self) -> np.ndarray:
        """`all_slots()` as a host int64 array: kept as segments are added (a cache hit's and a decode
        step's tables are known without a device call); read from the device only where a shared
        segment came without its host slots."""
        if self._host is None or self._host.shape[0] != self.length:
            self._host = self.all_slots().cpu().numpy() if self.segments else np.zeros(0, np.int64)
        return self._host

    def _extend_host(self, before: int, host: np.ndarray | None) -> None:
        """Keep the host slots current after a segment of host slots `host` (None: not known) was
        appended to a sequence of `before` positions."""
        known = self._host if self._host is not None else np.zeros(0, np.int64) if before == 0 else None
        current = host is not None and known is not None and known.shape[0] == before
        self._host = np.concatenate([known, host]) if current else None

    @property
    def length(self) -> int:
        return self.segments[-1].end if self.segments else 0

    def scratch(self, num_tokens: int) -> torch.Tensor:
        """Slots in fresh blocks owned by the request but outside its sequence (freed on release)."""
        blocks = self.pool.allocate(self.pool.blocks_for(num_tokens))
        self.scratch_blocks.extend(blocks)
        return self.pool.slots(blocks, num_tokens)

    def add_shared(self, key: str | None, slots: torch.Tensor, host: np.ndarray | None = None) -> Segment:
        """Append positions whose KV lives at `slots` (`host`: the same slots on the host, if known)."""
        before = self.length
        seg = Segment(before, slots, key)
        self.segments.append(seg)
        self._extend_host(before, host)
        return seg

    def add_own(self, num_tokens: int) -> Segment:
        """Append `num_tokens` positions stored in the request's own blocks (allocated here)."""
        need = self.pool.blocks_for(self.own_tokens + num_tokens) - len(self.own_blocks)
        if need > 0:
            self.own_blocks.extend(self.pool.allocate(need))
        host = self.pool.host_slots(self.own_blocks, num_tokens, self.own_tokens)
        slots = torch.from_numpy(host).to(self.pool.device)
        self.own_tokens += num_tokens
        self._extend_host(self.length, host)
        last = self.segments[-1] if self.segments else None
        if last is not None and last.shared_key is None:
            last.slots = torch.cat([last.slots, slots])
            return Segment(self.length - num_tokens, slots, None)
        seg = Segment(self.length, slots, None)
        self.segments.append(seg)
        return seg

    def all_slots(self) -> torch.Tensor:
        return torch.cat([s.slots for s in self.segments])

    def slot_of(self, position: int) -> int:
        """The slot of `position` (from the host slots: no device read where they are known)."""
        if not 0 <= position < self.length:
            raise IndexError(f"position {position} is past the sequence length {self.length}")
        return int(self.host_slots()[position])

    def release(self) -> None:
        """Give the request's own blocks back to the pool."""
        self.pool.free(self.own_blocks + self.scratch_blocks)
        self.own_blocks = []
        self.scratch_blocks = []
        self.own_tokens = 0
        self.segments = []
        self._host = None

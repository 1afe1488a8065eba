"""Fast-numerics attention for a decode forward: one row per request, attending to all its keys.

Every request's keys are listed in one slot table (a row per request, its slots in sequence
order, padded), built on the host from the block tables and copied to the device in one call.
On CUDA one Triton kernel per layer reads the keys straight from the paged pool
(`kvdiff/engine/paged_kernel.py`); elsewhere the keys are gathered and attended with SDPA. A
decode step therefore costs the same few device calls per layer for one request or for 32,
with or without a shared system chunk. Gathering is what costs on the host: there, keys every
row shares (the same slots at the head of every row's list: a cached system chunk) are gathered
once and attended by all rows together, then merged with each row's own keys (a cascade).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from kvdiff.engine.partial_attention import merge_states, partial_attention, single_attention, with_sinks
from kvdiff.engine.kv_cache import BlockPool, slot_run

MIN_SHARED = 32     # shared keys worth a cascade on the host


@dataclass
class PagedDecode:
    """The slot table of one decode forward; `attend` runs one layer with it."""

    table: torch.Tensor      # (G, Lmax) int64: row i's keys are table[i, :lengths[i]]
    lengths: torch.Tensor    # (G,) int64
    new_slots: torch.Tensor  # (G,) int64: each row's own slot, its last key, where its K/V go
    shared: int = 0          # the first `shared` slots are every row's (0: fewer than MIN_SHARED, or one row)
    exact: bool = False      # exact numerics on CUDA: the table holds every key by position, cut by `window`
    window: int | None = None
    ragged: bool = True      # some row has fewer keys than the table's width (False: each row sees its whole row)
    run: slice | None = None  # one row whose keys are consecutive slots (kv_cache.slot_run): read in place

    @classmethod
    def build(cls, key_slots: list[np.ndarray], device: torch.device, exact: bool = False,
              window: int | None = None) -> "PagedDecode":
        """From each row's key slots (host arrays, in sequence order), in one host-to-device copy;
        `exact`: attended with exact numerics' kernel under `window` (the slots are all of the
        row's keys, from position 0)."""
        G = len(key_slots)
        width = max(s.shape[0] for s in key_slots)
        packed = np.zeros((G, width + 2), dtype=np.int64)
        for i, slots in enumerate(key_slots):
            packed[i, 0] = slots.shape[0]
            packed[i, 1] = slots[-1]
            packed[i, 2:2 + slots.shape[0]] = slots
        on_device = torch.from_numpy(packed).to(device)
        return cls(on_device[:, 2:], on_device[:, 0], on_device[:, 1], 0 if exact else _shared_head(key_slots),
                   exact, window, any(slots.shape[0] != width for slots in key_slots),
                   slot_run(key_slots[0]) if G == 1 and not exact else None)

    def to(self, device: torch.device) -> "PagedDecode":
        """The table on another device (a model split across GPUs)."""
        if self.table.device == device:
            return self
        return PagedDecode(self.table.to(device), self.lengths.to(device), self.new_slots.to(device), self.shared,
                           self.exact, self.window, self.ragged, self.run)

    def attend(self, pool: BlockPool, layer: int, q: torch.Tensor, scale: float,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output (G, H, D) in q's dtype for the rows q (G, H, D); `sinks` (H,): per-head
        sink logits (gpt-oss)."""
        k_pool, v_pool = pool.k[layer], pool.v[layer]
        if self.exact:
            from kvdiff.engine import gpu_kernels

            return gpu_kernels.paged_attention(q, k_pool, v_pool, self.table, self.lengths, self.window, scale, sinks)
        if q.is_cuda and pool.holds_kv:      # (an MLA pool's rows are expanded first: the gathering path)
            from kvdiff.engine import paged_kernel

            if paged_kernel.available:
                return paged_kernel.paged_decode(q, k_pool, v_pool, self.table, self.lengths, scale, sinks)
        if self.shared:
            return self._cascade(pool, layer, q, scale, sinks)
        k, v, visible = self._gathered(pool, layer, 0)
        if sinks is None:
            return single_attention(q.unsqueeze(1), k, v, visible, scale).squeeze(1)
        o, lse = partial_attention(q.unsqueeze(1), k, v, visible, scale)
        return with_sinks(o.squeeze(1), lse.squeeze(1), sinks).to(q.dtype)

    def _cascade(self, pool: BlockPool, layer: int, q: torch.Tensor, scale: float,
                 sinks: torch.Tensor | None) -> torch.Tensor:
        """`attend` with the shared keys gathered once: every row against them (they are all
        earlier than every row), each row against its own rest, the two states merged."""
        P = self.shared
        k, v = pool.read(layer, self.table[0, :P])
        o_shared, lse_shared = partial_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), None, scale)
        k, v, visible = self._gathered(pool, layer, P)
        o_own, lse_own = partial_attention(q.unsqueeze(1), k, v, visible, scale)
        o, lse = merge_states(o_shared[0], lse_shared[0], o_own[:, 0], lse_own[:, 0])
        return (o if sinks is None else with_sinks(o, lse, sinks)).to(q.dtype)

    def _gathered(self, pool: BlockPool, layer: int, first: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                        torch.Tensor | None]:
        """Each row's keys and values from table column `first` (0, or `shared`) on, (G, width - first,
        KVH, D), and which of them it sees (`own_visible`)."""
        G, width = self.table.shape
        if self.run is not None and first == 0:
            k, v = pool.read(layer, self.run)
        else:
            k, v = pool.read(layer, self.table[:, first:].reshape(-1))
        k, v = k.view(G, width - first, *k.shape[1:]), v.view(G, width - first, *v.shape[1:])
        return k, v, self.own_visible

    @functools.cached_property
    def own_visible(self) -> torch.Tensor | None:
        """Which of its keys from table column `shared` on each row sees, (G, 1, width - shared): those
        within its length; None where every row sees all of them. Made once a forward, not a layer."""
        if not self.ragged:
            return None
        first = self.shared
        visible = torch.arange(self.table.shape[1] - first, device=self.table.device) < (self.lengths - first).unsqueeze(1)
        return visible.unsqueeze(1)


def _shared_head(key_slots: list[np.ndarray]) -> int:
    """How many leading slots every row's list holds alike; 0 below MIN_SHARED or for one row."""
    if len(key_slots) < 2:
        return 0
    n = min(s.shape[0] for s in key_slots) - 1          # each row's last key is its own
    if n < MIN_SHARED:
        return 0
    heads = np.stack([s[:n] for s in key_slots])
    differs = np.flatnonzero((heads != heads[0]).any(0))
    shared = int(differs[0]) if differs.size else n
    return shared if shared >= MIN_SHARED else 0

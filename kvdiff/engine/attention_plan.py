"""The attention of one forward, per sliding window: which keys each row group reads, and how.

A model may mix global layers with sliding-window ones (Gemma 3, gpt-oss). Keys are prepared
once per forward for each distinct window of the model's layers (None: global). A windowed
layer's keys are cut to the window of the group's first row: keys that fell out of every row's
window are not read at all (in exact numerics the cut falls on a KEY_TILE boundary, so the key
tiles stay aligned to position 0 and a row's bits do not depend on where the cut is), and each
row's visibility masks its own window (a query at p sees p-window+1..p, as transformers' sliding
mask does). The paged cache keeps those rows: a block holds every layer's K/V and the global
layers still read them, so out of a window they are masked and skipped, not freed.

The plan per window is exact tiles (exact numerics), a cascade (fast prefill) or a paged decode
table (fast decode: each row's last `window` slots; exact decode on CUDA: all of a row's slots,
the window cut in the kernel on the tiles' alignment).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvdiff.engine.cascade import CascadePlan
from kvdiff.engine.kv_cache import BlockPool
from kvdiff.engine.exact_attention import KEY_TILE, exact_attention
from kvdiff.engine.paged_decode import PagedDecode


ONE_GROUP_CASCADE_KEYS = 512     # a shared first segment this long is worth a cascade for one group


@dataclass
class KeySet:
    """A group's key slots and visibility under one window, prepared once per forward."""

    slots: torch.Tensor           # (L,)
    visible: torch.Tensor         # (T, L) bool
    shared: str | None            # key of a first segment shared with another group in this forward
    shared_len: int
    sees_all: bool                # every row sees every key (decode): attention needs no mask
    diagonal: int | None = None   # row i sees exactly keys 0..i + diagonal (exact numerics' kernel needs no mask)

    @property
    def causal(self) -> bool:
        """As many rows as keys, row i at key i's position, attended apart from any shared first
        segment: row i sees keys 0..i (SDPA's causal mask)."""
        return self.shared is None and self.diagonal == 0


def key_sets(groups: list, window: int | None, exact: bool, device: torch.device) -> list[KeySet]:
    """Each group's keys (runner.RowGroup's segments, rows at `positions`, none below `lo`) under
    `window` (None: every earlier key)."""
    first_shared: dict[str, int] = {}
    for g in groups:
        if g.segments and g.segments[0].shared_key:
            first_shared[g.segments[0].shared_key] = first_shared.get(g.segments[0].shared_key, 0) + 1
    out = []
    for g in groups:
        first = g.segments[0].start
        if window is not None:
            align = KEY_TILE if exact else 1
            first = max(first, (min(g.positions) - window + 1) // align * align)
        segments = [(max(first, s.start), s.slots[max(0, first - s.start):], s) for s in g.segments if s.end > first]
        slots = torch.cat([sl for _, sl, _ in segments])
        kpos = torch.arange(segments[0][0], g.segments[-1].end, device=device)    # segments follow each other
        qpos = torch.tensor(g.positions, device=device)
        visible = kpos.unsqueeze(0) <= qpos.unsqueeze(1)
        if g.lo > segments[0][0]:
            visible &= kpos.unsqueeze(0) >= g.lo
        if window is not None:
            visible &= kpos.unsqueeze(0) > qpos.unsqueeze(1) - window
        whole, head = segments[0][0] == g.segments[0].start, g.segments[0]
        key = head.shared_key if whole else None     # a cut first segment is no longer the shared one
        # one group alone attends to a long cached first segment apart on the CPU too: no mask
        # over its keys (all earlier than every row), read in place (cascade.SharedPart)
        alone = (device.type == "cpu" and min(g.positions) >= head.end
                 and int(head.slots.shape[0]) >= ONE_GROUP_CASCADE_KEYS)
        cascade = not exact and key is not None and (first_shared[key] > 1 or alone)
        kfirst = segments[0][0]
        sees_all = (min(g.positions) >= g.segments[-1].end - 1 and g.lo <= kfirst
                    and (window is None or max(g.positions) - window < kfirst))
        n_keys = g.segments[-1].end - kfirst
        # rows at consecutive positions up to the last key, seeing every key up to their own
        diagonal = None
        if (g.lo <= kfirst and (window is None or window >= n_keys)
                and g.positions == list(range(g.positions[0], kfirst + n_keys))):
            diagonal = g.positions[0] - kfirst
        out.append(KeySet(slots, visible, key if cascade else None,
                          int(head.slots.shape[0]) if cascade else 0, sees_all, diagonal))
    return out


@dataclass
class WindowPlan:
    """One window's keys and plan: exact (plan None, keys per group), cascade or paged decode."""

    keys: list[KeySet]
    plan: CascadePlan | PagedDecode | None


class ForwardAttention:
    """Attention of one forward's groups for every window of the model's layers."""

    def __init__(self, plans: dict[int | None, WindowPlan], spans: list[slice], decode_slots: torch.Tensor | None):
        self.plans = plans
        self.spans = spans
        self.decode_slots = decode_slots      # fast decode: each row's own slot, where its K/V go

    @classmethod
    def build(cls, groups: list, spans: list[slice], windows: tuple[int | None, ...],
              keys_of: Callable[[list, int | None], list[KeySet]], exact: bool, device: torch.device,
              paged_exact: bool = False) -> "ForwardAttention":
        """Plans for `windows`: a paged decode table per window when every group is a decode row
        (in fast numerics, or in exact ones where `paged_exact`: one table, each window cut in the
        kernel), else the key sets `keys_of(groups, window)` (`key_sets`, or a test's plant) and in
        fast numerics a cascade plan, per window."""
        plans: dict[int | None, WindowPlan] = {}
        if (not exact or paged_exact) and all(g.key_slots is not None for g in groups):
            whole = PagedDecode.build([g.key_slots for g in groups], device, exact) if exact else None
            for w in windows:
                if exact:
                    plan = PagedDecode(whole.table, whole.lengths, whole.new_slots, 0, True, w)
                else:
                    plan = PagedDecode.build([g.key_slots if w is None else g.key_slots[-w:] for g in groups], device)
                plans[w] = WindowPlan([], plan)
            return cls(plans, spans, plans[windows[0]].plan.new_slots)
        for w in windows:
            keys = keys_of(groups, w)
            plans[w] = WindowPlan(keys, None if exact else CascadePlan.build(spans, keys, device))
        return cls(plans, spans, None)

    def to(self, device: torch.device) -> "ForwardAttention":
        """The plans on another device (a model split across GPUs); exact key sets move per use."""
        plans = {w: WindowPlan(p.keys, p.plan.to(device) if p.plan is not None else None) for w, p in self.plans.items()}
        slots = self.decode_slots.to(device) if self.decode_slots is not None else None
        return ForwardAttention(plans, self.spans, slots)

    def attend(self, pool: BlockPool, layer: int, window: int | None, q: torch.Tensor, scale: float,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output (N, H, D) in q's dtype of layer `layer` (of sliding window `window`) for
        the forward's rows q (N, H, D); `sinks` (H,): per-head sink logits (gpt-oss)."""
        p = self.plans[window]
        if p.plan is not None:
            return p.plan.attend(pool, layer, q, scale, sinks)
        outs = []
        for span, kk in zip(self.spans, p.keys):
            k, v = pool.read(layer, kk.slots)
            outs.append(exact_attention(q[span], k, v, kk.visible.to(q.device), scale, sinks, kk.diagonal))
        return torch.cat(outs)


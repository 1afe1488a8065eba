"""Cascade attention (fast numerics): partial attention states merged by log-sum-exp, over a
batch of row groups planned once per forward.

A partial state over one key segment is (o, lse): the softmax-weighted values over that
segment alone and the natural-log sum of its exp-scores. Two states over disjoint segments
merge exactly as FlashInfer's merge_state does (FlashInfer works in base 2 internally; here
every log and exp is natural, consistently). An empty or fully masked segment is (0, -inf)
and merges as the identity.

Groups whose first key segment is the same shared chunk attend to it together (one partial
attention over the chunk's pages for all their rows); each group attends to the rest of its
keys alone, padded into one batch; the two partial states are merged by log-sum-exp. Every
index the layers need (padding, key slots, masks, shared rows) is built once per forward, so
a layer costs a fixed handful of kernels whatever the number of groups: decoding 32 requests
runs as fast per layer as decoding one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvdiff.engine.kv_cache import BlockPool

NEG_INF = float("-inf")


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over one key segment, with its log-sum-exp.

    q (B, T, H, D); k, v (B, L, KVH, D); visible (B, T, L) bool or None (all visible).
    Returns o (B, T, H, D) float32 and lse (B, T, H) float32; rows that see no key get (0, -inf).
    """
    B, T, H, D = q.shape
    L, KVH = k.shape[1], k.shape[2]
    groups = H // KVH
    if L == 0:
        return q.new_zeros((B, T, H, D), dtype=torch.float32), q.new_full((B, T, H), NEG_INF, dtype=torch.float32)
    qf = q.float().view(B, T, KVH, groups, D).permute(0, 2, 3, 1, 4).reshape(B, KVH, groups * T, D)
    kf = k.float().permute(0, 2, 3, 1)                     # (B, KVH, D, L)
    vf = v.float().permute(0, 2, 1, 3)                     # (B, KVH, L, D)
    s = torch.matmul(qf, kf) * scale                       # (B, KVH, G*T, L)
    if visible is not None:
        hidden = ~visible.unsqueeze(1).unsqueeze(1).expand(B, 1, groups, T, L).reshape(B, 1, groups * T, L)
        s = s.masked_fill(hidden, NEG_INF)
    m = s.amax(-1, keepdim=True)
    m_safe = m.masked_fill(m == NEG_INF, 0.0)
    p = torch.exp(s - m_safe)
    denom = p.sum(-1, keepdim=True)
    o = torch.matmul(p, vf) / denom.clamp_min(torch.finfo(torch.float32).tiny)
    lse = (m_safe + torch.log(denom)).squeeze(-1)          # log(0) = -inf for empty rows
    o = o.view(B, KVH, groups, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H, D)
    lse = lse.view(B, KVH, groups, T).permute(0, 3, 1, 2).reshape(B, T, H)
    return o, lse


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                 lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial states over disjoint key sets: (o, lse) of attention over their union."""
    lse = torch.logaddexp(lse_a, lse_b)
    lse_safe = lse.masked_fill(lse == NEG_INF, 0.0)
    w_a = torch.exp(lse_a - lse_safe).unsqueeze(-1)
    w_b = torch.exp(lse_b - lse_safe).unsqueeze(-1)
    return o_a * w_a + o_b * w_b, lse


def single_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """One-segment attention through SDPA (every row must see at least one key).

    Shapes as in `partial_attention`; returns (B, T, H, D) in q's dtype.
    """
    mask = None if visible is None else visible.unsqueeze(1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


@dataclass
class SharedPart:
    """Rows of the groups that share one first segment, and that segment's keys."""

    slots: torch.Tensor           # (S,) the shared segment's slots
    q_rows: torch.Tensor          # (R,) rows of q (in forward order) of the member groups
    padded_rows: torch.Tensor     # (R,) the same rows in the padded (G * Tmax) layout
    visible: torch.Tensor         # (1, R, S) bool


@dataclass
class CascadePlan:
    """Padding and key layout of one forward's groups; `attend` runs one layer with it."""

    groups: int
    width: int                    # Tmax: rows of the longest group
    padded_rows: torch.Tensor     # (N,) where each q row goes in the padded (G * Tmax) layout
    slots: torch.Tensor           # (G, Lrest) slots of each group's own (non-shared) keys, 0-padded
    visible: torch.Tensor | None  # (G, Tmax, Lrest) bool; None: every row sees all its keys, none padded
    shared: list[SharedPart]
    unpadded: bool = False        # every group has Tmax rows: the padded layout is q's own

    @classmethod
    def build(cls, spans: list[slice], keys: list, device: torch.device) -> "CascadePlan":
        """`keys[i]` (runner._Keys) has slots, visible, shared and shared_len for group i."""
        G = len(spans)
        lengths = [s.stop - s.start for s in spans]
        width = max(lengths)
        rest = [(kk.slots[kk.shared_len:], kk.visible[:, kk.shared_len:]) for kk in keys]
        lrest = max(1, max(int(r[0].shape[0]) for r in rest))
        unmasked = all(kk.sees_all and kk.slots.shape[0] - kk.shared_len == lrest for kk in keys)
        if G == 1 and lrest == rest[0][0].shape[0]:
            slots = rest[0][0].view(1, lrest)
        else:
            slots = torch.zeros((G, lrest), dtype=torch.long, device=device)
            for i, (sl, _) in enumerate(rest):
                slots[i, : sl.shape[0]] = sl
        visible = None
        if not unmasked:
            visible = torch.zeros((G, width, lrest), dtype=torch.bool, device=device)
            for i, (T, (sl, vi)) in enumerate(zip(lengths, rest)):
                visible[i, :T, : sl.shape[0]] = vi
        padded = torch.cat([torch.arange(T, device=device) + i * width for i, T in enumerate(lengths)])
        shared = []
        for key in dict.fromkeys(kk.shared for kk in keys if kk.shared):
            members = [i for i, kk in enumerate(keys) if kk.shared == key]
            first = keys[members[0]]
            shared.append(SharedPart(
                slots=first.slots[: first.shared_len].to(device),
                q_rows=torch.cat([torch.arange(spans[i].start, spans[i].stop, device=device) for i in members]),
                padded_rows=torch.cat([padded[spans[i]] for i in members]),
                visible=torch.cat([keys[i].visible[:, : first.shared_len] for i in members]).unsqueeze(0).to(device),
            ))
        return cls(G, width, padded, slots, visible, shared,
                   unpadded=all(T == width for T in lengths))

    def to(self, device: torch.device) -> "CascadePlan":
        """The plan on another device (a model split across GPUs)."""
        if self.slots.device == device:
            return self
        return CascadePlan(self.groups, self.width, self.padded_rows.to(device), self.slots.to(device),
                           None if self.visible is None else self.visible.to(device),
                           [SharedPart(p.slots.to(device), p.q_rows.to(device), p.padded_rows.to(device),
                                       p.visible.to(device)) for p in self.shared], self.unpadded)

    def attend(self, pool: BlockPool, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention output (N, H, D) in q's dtype for the forward's rows q (N, H, D)."""
        N, H, D = q.shape
        G, W = self.groups, self.width
        if self.unpadded:
            qp = q.view(G, W, H, D)
        else:
            qp = q.new_zeros((G * W, H, D)).index_copy_(0, self.padded_rows, q).view(G, W, H, D)
        k, v = pool.read(layer, self.slots.view(-1))
        k, v = k.view(G, -1, *k.shape[1:]), v.view(G, -1, *v.shape[1:])
        if not self.shared:
            o = single_attention(qp, k, v, self.visible, scale).reshape(G * W, H, D)
            return o if self.unpadded else o.index_select(0, self.padded_rows)
        o, lse = partial_attention(qp, k, v, self.visible, scale)
        o, lse = o.reshape(G * W, H, D), lse.reshape(G * W, H)
        for part in self.shared:
            ks, vs = pool.read(layer, part.slots)
            qs = q.index_select(0, part.q_rows).unsqueeze(0)
            os_, lses = partial_attention(qs, ks.unsqueeze(0), vs.unsqueeze(0), part.visible, scale)
            rows = part.padded_rows
            merged, merged_lse = merge_states(o.index_select(0, rows), lse.index_select(0, rows), os_[0], lses[0])
            o.index_copy_(0, rows, merged)
            lse.index_copy_(0, rows, merged_lse)
        return o.index_select(0, self.padded_rows).to(q.dtype)

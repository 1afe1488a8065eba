"""Cascade attention (fast numerics): partial attention states (partial_attention.py) merged by
log-sum-exp, over a batch of row groups planned once per forward.

Groups whose first key segment is the same shared chunk attend to it together (one partial
attention over the chunk's pages for all their rows). Each group attends to the rest of its keys
in a bucket of groups of similar size, padded into one batch: as a partial state, merged with
the shared one by log-sum-exp, where the group shares a first segment; through SDPA where it
does not. Buckets bound the padding: a bucket's padded score cells (groups x its longest
group's rows x its most keys) are at most twice its groups' own, or PAD_SLACK cells, so one
1,177-token prompt among eleven short ones is no longer padded into each of them (12 x 1,177 x
1,177 scores a layer, 2.6 GB of temporaries). Every index the layers need (padding, key slots, masks, shared
rows) is built once per forward, so a layer costs a fixed handful of kernels per bucket
whatever the number of groups: 32 requests of one shape run as one batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdiff.engine.kv_cache import BlockPool, slot_run
from kvdiff.engine.partial_attention import merge_states, partial_attention, single_attention, with_sinks

PAD_SLACK = 1 << 16      # padded score cells (rows x keys) a bucket may hold whatever its own


def plan_buckets(rows: list[int], keys: list[int]) -> list[list[int]]:
    """Group indices in buckets of similar size, each in forward order: a bucket's padded cells
    (members x most rows x most keys) stay within twice its members' own cells or PAD_SLACK."""
    order = sorted(range(len(rows)), key=lambda i: (rows[i] * keys[i], rows[i]))
    buckets: list[list[int]] = []
    members: list[int] = []
    width = most_keys = own = 0
    for i in order:
        w, lk, o = max(width, rows[i]), max(most_keys, keys[i]), own + rows[i] * keys[i]
        if members and (len(members) + 1) * w * lk > max(2 * o, PAD_SLACK):
            buckets.append(sorted(members))
            members, w, lk, o = [], rows[i], keys[i], rows[i] * keys[i]
        members.append(i)
        width, most_keys, own = w, lk, o
    buckets.append(sorted(members))
    return buckets


@dataclass
class SharedPart:
    """Rows of the groups that share one first segment, and that segment's keys."""

    slots: torch.Tensor | slice   # (S,) the shared segment's slots, or their run (kv_cache.slot_run)
    q_rows: torch.Tensor          # (R,) rows of q (in forward order) of the member groups
    visible: torch.Tensor | None  # (1, R, S) bool; None: every row sees every key of the segment


@dataclass
class Bucket:
    """Groups of similar size padded into one batch: each attends to its own (non-shared) keys."""

    groups: int
    width: int                    # Tmax: rows of the bucket's longest group
    rows: torch.Tensor | None     # (n,) its rows of q in forward order; None: every row of the forward
    padded_rows: torch.Tensor     # (n,) where each of those rows goes in the padded (G * Tmax) layout
    slots: torch.Tensor           # (G, Lrest) slots of each group's own keys, 0-padded
    visible: torch.Tensor | None  # (G, Tmax, Lrest) bool; None: every row sees all its keys, none padded
    unpadded: bool                # every group has Tmax rows: the padded layout is the rows' own
    shares: bool                  # its groups share a first segment: attend gives partial states
    causal: bool = False          # one group whose row i sees its keys 0..i and no other: `single` asks SDPA
                                  # for a causal mask instead of `visible` (flash attention, 4x faster on an H200)

    @classmethod
    def build(cls, members: list[int], spans: list[slice], keys: list, device: torch.device,
              whole: bool) -> "Bucket":
        """The bucket of groups `members`; `whole`: they are every group of the forward."""
        lengths = [spans[i].stop - spans[i].start for i in members]
        width = max(lengths)
        rest = [(keys[i].slots[keys[i].shared_len:], keys[i].visible[:, keys[i].shared_len:]) for i in members]
        lrest = max(1, max(int(sl.shape[0]) for sl, _ in rest))
        unmasked = all(keys[i].sees_all and sl.shape[0] == lrest for i, (sl, _) in zip(members, rest))
        if len(members) == 1 and lrest == rest[0][0].shape[0]:
            slots = rest[0][0].view(1, lrest)
        else:
            slots = torch.zeros((len(members), lrest), dtype=torch.long, device=device)
            for j, (sl, _) in enumerate(rest):
                slots[j, : sl.shape[0]] = sl
        visible = None
        if not unmasked and len(members) == 1 and rest[0][1].shape == (width, lrest):
            visible = rest[0][1].unsqueeze(0)
        elif not unmasked:
            visible = torch.zeros((len(members), width, lrest), dtype=torch.bool, device=device)
            for j, (T, (sl, vi)) in enumerate(zip(lengths, rest)):
                visible[j, :T, : sl.shape[0]] = vi
        padded = torch.cat([torch.arange(T, device=device) + j * width for j, T in enumerate(lengths)])
        rows = None if whole else torch.cat([torch.arange(spans[i].start, spans[i].stop, device=device)
                                             for i in members])
        return cls(len(members), width, rows, padded, slots, visible, all(T == width for T in lengths),
                   any(keys[i].shared for i in members), len(members) == 1 and keys[members[0]].causal)

    def to(self, device: torch.device) -> "Bucket":
        """The bucket on another device."""
        return Bucket(self.groups, self.width, None if self.rows is None else self.rows.to(device),
                      self.padded_rows.to(device), self.slots.to(device),
                      None if self.visible is None else self.visible.to(device), self.unpadded, self.shares,
                      self.causal)

    def _inputs(self, pool: BlockPool, layer: int, q: torch.Tensor):
        G, W, (_, H, D) = self.groups, self.width, q.shape
        x = q if self.rows is None else q.index_select(0, self.rows)
        if self.unpadded:
            qp = x.view(G, W, H, D)
        else:
            qp = x.new_zeros((G * W, H, D)).index_copy_(0, self.padded_rows, x).view(G, W, H, D)
        k, v = pool.read(layer, self.slots.view(-1))
        return qp, k.view(G, -1, *k.shape[1:]), v.view(G, -1, *v.shape[1:])

    def _unpad(self, t: torch.Tensor) -> torch.Tensor:
        t = t.reshape(self.groups * self.width, *t.shape[2:])
        return t if self.unpadded else t.index_select(0, self.padded_rows)

    def single(self, pool: BlockPool, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention output of the bucket's rows (n, H, D), in q's dtype."""
        qp, k, v = self._inputs(pool, layer, q)
        if self.causal:
            return self._unpad(single_attention(qp, k, v, None, scale, causal=True))
        return self._unpad(single_attention(qp, k, v, self.visible, scale))

    def partial(self, pool: BlockPool, layer: int, q: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Partial state (o (n, H, D), lse (n, H)) of the bucket's rows over their own keys."""
        qp, k, v = self._inputs(pool, layer, q)
        o, lse = partial_attention(qp, k, v, self.visible, scale)
        return self._unpad(o), self._unpad(lse)


@dataclass
class CascadePlan:
    """Buckets and shared segments of one forward's groups; `attend` runs one layer with it."""

    buckets: list[Bucket]
    shared: list[SharedPart]

    @classmethod
    def build(cls, spans: list[slice], keys: list, device: torch.device) -> "CascadePlan":
        """`keys[i]` (attention_plan.KeySet) has slots, visible, shared and shared_len for group i."""
        rows = [s.stop - s.start for s in spans]
        own_keys = [max(1, int(kk.slots.shape[0]) - kk.shared_len) for kk in keys]
        members = []     # groups with a shared segment need partial states, the others only SDPA's output
        for shares in (True, False):
            part = [i for i, kk in enumerate(keys) if bool(kk.shared) == shares]
            if part:
                buckets = plan_buckets([rows[i] for i in part], [own_keys[i] for i in part])
                members += [[part[j] for j in m] for m in buckets]
        buckets = [Bucket.build(m, spans, keys, device, whole=len(members) == 1) for m in members]
        shared = []
        for key in dict.fromkeys(kk.shared for kk in keys if kk.shared):
            group = [i for i, kk in enumerate(keys) if kk.shared == key]
            first = keys[group[0]]
            slots = first.slots[: first.shared_len].to(device)
            visible = torch.cat([keys[i].visible[:, : first.shared_len] for i in group]).unsqueeze(0).to(device)
            if device.type == "cpu" and bool(visible.all()):      # (no device read-back elsewhere)
                visible = None
            run = slot_run(slots)
            shared.append(SharedPart(
                slots=slots if run is None else run,
                q_rows=torch.cat([torch.arange(spans[i].start, spans[i].stop, device=device) for i in group]),
                visible=visible,
            ))
        return cls(buckets, shared)

    def to(self, device: torch.device) -> "CascadePlan":
        """The plan on another device (a model split across GPUs)."""
        if self.buckets[0].slots.device == device:
            return self
        return CascadePlan([b.to(device) for b in self.buckets],
                           [SharedPart(p.slots if isinstance(p.slots, slice) else p.slots.to(device),
                                       p.q_rows.to(device), None if p.visible is None else p.visible.to(device))
                            for p in self.shared])

    def attend(self, pool: BlockPool, layer: int, q: torch.Tensor, scale: float,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output (N, H, D) in q's dtype for the forward's rows q (N, H, D); `sinks` (H,):
        per-head sink logits (every bucket then gives partial states, to fold them in)."""
        if self.buckets[0].rows is None:      # one bucket holds every group
            if not self.buckets[0].shares and sinks is None:
                return self.buckets[0].single(pool, layer, q, scale)
            o, lse = self.buckets[0].partial(pool, layer, q, scale)
        else:
            N, H, _ = q.shape
            o = q.new_empty((N, H, pool.value_dim), dtype=torch.float32)
            lse = q.new_empty((N, H), dtype=torch.float32)     # read only at the shared parts' rows
            for b in self.buckets:
                if b.shares or sinks is not None:
                    ob, lb = b.partial(pool, layer, q, scale)
                    o.index_copy_(0, b.rows, ob)
                    lse.index_copy_(0, b.rows, lb)
                else:
                    o.index_copy_(0, b.rows, b.single(pool, layer, q, scale).float())
        for part in self.shared:
            ks, vs = pool.read(layer, part.slots)
            qs = q.index_select(0, part.q_rows).unsqueeze(0)
            os_, lses = partial_attention(qs, ks.unsqueeze(0), vs.unsqueeze(0), part.visible, scale)
            rows = part.q_rows
            merged, merged_lse = merge_states(o.index_select(0, rows), lse.index_select(0, rows), os_[0], lses[0])
            o.index_copy_(0, rows, merged)
            lse.index_copy_(0, rows, merged_lse)
        if sinks is not None:
            o = with_sinks(o, lse, sinks)
        return o.to(q.dtype)

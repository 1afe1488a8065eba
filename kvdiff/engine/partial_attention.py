"""Partial attention states: attention over one key segment with its log-sum-exp, and their merge.

A partial state over one key segment is (o, lse): the softmax-weighted values over that
segment alone and the natural-log sum of its exp-scores. Two states over disjoint segments
merge exactly as FlashInfer's merge_state does (FlashInfer works in base 2 internally; here
every log and exp is natural, consistently). An empty or fully masked segment is (0, -inf)
and merges as the identity. Used by the cascade (cascade.py) and the host decode
(paged_decode.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

NEG_INF = float("-inf")
SCORE_BUDGET = 1 << 24   # score elements one partial-attention block holds (64 MiB in float32)
NO_PLAN_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]   # not cuDNN


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over one key segment, with its log-sum-exp.

    q (B, T, H, D); k, v (B, L, KVH, D); visible (B, T, L) bool or None (all visible).
    Returns o (B, T, H, D) float32 and lse (B, T, H) float32; rows that see no key get (0, -inf).
    On the CPU one call of the fused kernel SDPA runs there; elsewhere query rows are taken in
    blocks of at most SCORE_BUDGET score elements.
    """
    B, T, H, D = q.shape
    L = k.shape[1]
    if L == 0:
        return q.new_zeros((B, T, H, v.shape[-1]), dtype=torch.float32), q.new_full((B, T, H), NEG_INF, dtype=torch.float32)
    if _fused(q, v):
        return _partial_fused(q, k, v, visible, scale)
    block = max(1, SCORE_BUDGET // (B * H * L))
    if T <= block:
        return _partial_block(q, k, v, visible, scale)
    parts = [_partial_block(q[:, t:t + block], k, v, None if visible is None else visible[:, t:t + block], scale)
             for t in range(0, T, block)]
    return torch.cat([o for o, _ in parts], 1), torch.cat([lse for _, lse in parts], 1)


# SDPA's CPU flash kernel with its log-sum-exp is a private torch op: used where this torch has it
FUSED_CPU = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _fused(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `partial_attention` runs the CPU's fused kernel (values as wide as the queries)."""
    return q.device.type == "cpu" and v.shape[-1] == q.shape[-1] and FUSED_CPU


def _partial_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`partial_attention` by SDPA's CPU flash kernel, which returns the log-sum-exp too: its tiles
    keep no score temporaries (the separate matmul, mask, exp and sum passes took 3.5x its time
    for 949 rows against 595 shared keys); it gives a row that sees no key lse 0, set to -inf here."""
    mask = None
    if visible is not None:
        mask = torch.zeros(visible.shape, device=q.device).masked_fill_(~visible, NEG_INF).unsqueeze(1)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2), attn_mask=mask, scale=scale)
    lse = lse.transpose(1, 2)
    if visible is not None:
        lse = lse.masked_fill(~visible.any(-1, keepdim=True), NEG_INF)
    return o.transpose(1, 2), lse


def _partial_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, H, D = q.shape
    L, KVH = k.shape[1], k.shape[2]
    groups = H // KVH
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
    Dv = v.shape[-1]                                       # the values' width (MLA's differs from D)
    o = o.view(B, KVH, groups, T, Dv).permute(0, 3, 1, 2, 4).reshape(B, T, H, Dv)
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


def with_sinks(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention output `o` (N, H, D) over keys of log-sum-exp `lse` (N, H) with one more logit per
    head, `sinks` (H,), in the softmax's denominator (gpt-oss's attention sinks): the merge with a
    state of no values whose log-sum-exp is the sink."""
    sink = sinks.to(lse.device, torch.float32).expand_as(lse)
    return merge_states(o, lse, torch.zeros_like(o), sink)[0]


def single_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
                     scale: float, causal: bool = False) -> torch.Tensor:
    """One-segment attention through SDPA (every row must see at least one key); `causal`
    (with `visible` None): row i sees keys 0..i, for as many rows as keys.

    Shapes as in `partial_attention`; returns (B, T, H, D) in q's dtype.
    """
    mask = None if visible is None else visible.unsqueeze(1)
    if not q.is_cuda:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, scale=scale, enable_gqa=True, is_causal=causal)
        return out.transpose(1, 2)
    # For a masked grouped-query call SDPA picks cuDNN on Hopper, which builds a plan for each new
    # (rows, keys) shape: 40-600 ms, paid by nearly every request of a new length. The fused
    # kernels have no per-shape cost and take keys with as many heads as the queries.
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k, v = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
    with sdpa_kernel(NO_PLAN_BACKENDS):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, scale=scale, is_causal=causal)
    return out.transpose(1, 2)

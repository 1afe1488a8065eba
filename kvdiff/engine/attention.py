"""Fast attention: partial attention states merged by log-sum-exp (cascade attention).

A partial state over one key segment is (o, lse): the softmax-weighted values over that
segment alone and the natural-log sum of its exp-scores. Two states over disjoint segments
merge exactly as FlashInfer's merge_state does (FlashInfer works in base 2 internally; here
every log and exp is natural, consistently). An empty or fully masked segment is (0, -inf)
and merges as the identity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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

"""Triton kernel for fast-numerics decode attention straight from the paged KV pool.

One program per (request, KV head) computes the query heads that share that KV head: it walks
the request's slot table in tiles of `BLOCK_N` keys, gathers their K and V rows from the pool
and keeps an online softmax. Used by `PagedDecode.attend` on CUDA; `available` is False where
Triton is missing, and the gather-and-SDPA path runs instead.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    available = True
except ImportError:
    available = False
else:
    from kvdiff.engine.gpu_kernels import finish_softmax, online_softmax_tile

BLOCK_N = 64   # keys per tile


if available:
    @triton.jit
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, sink_ptr, o_ptr, scale,
                             sq_n, sq_h, sk_s, sk_h, sv_s, sv_h, st_n, sl_n, so_n, so_h,
                             GROUPS: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                             IEEE: tl.constexpr, HAS_SINKS: tl.constexpr, BN: tl.constexpr):
        row, kv_head = tl.program_id(0), tl.program_id(1)
        members = tl.arange(0, GP)
        heads = kv_head * GROUPS + members
        dims = tl.arange(0, DP)
        q_mask = (members[:, None] < GROUPS) & (dims[None, :] < D)
        q = tl.load(q_ptr + row * sq_n + heads[:, None] * sq_h + dims[None, :], mask=q_mask, other=0.0)
        length = tl.load(len_ptr + row * sl_n)
        m_i = tl.full((GP,), float("-inf"), tl.float32)
        l_i = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, DP), tl.float32)
        for start in range(0, length, BN):
            cols = start + tl.arange(0, BN)
            inside = cols < length
            slots = tl.load(table_ptr + row * st_n + cols, mask=inside, other=0)
            kv_mask = inside[:, None] & (dims[None, :] < D)
            k = tl.load(k_ptr + slots[:, None] * sk_s + kv_head * sk_h + dims[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + slots[:, None] * sv_s + kv_head * sv_h + dims[None, :], mask=kv_mask, other=0.0)
            m_i, l_i, acc = online_softmax_tile(q, k, v, inside[None, :], m_i, l_i, acc, scale, IEEE)
        sink = 0.0
        if HAS_SINKS:
            sink = tl.load(sink_ptr + heads, mask=members < GROUPS, other=0.0).to(tl.float32)
        out = finish_softmax(m_i, l_i, acc, sink, HAS_SINKS)
        tl.store(o_ptr + row * so_n + heads[:, None] * so_h + dims[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=q_mask)


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                 lengths: torch.Tensor, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one row per request: q (G, H, D); pools (slots, KVH, D), contiguous; table
    (G, Lmax) slots, rows of unit stride; lengths (G,) keys per row (at least one), any stride;
    sinks (H,) per-head sink logits or None. Returns (G, H, D) in q's dtype."""
    G, H, D = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    kv_heads = k_pool.shape[1]
    groups = H // kv_heads
    out = torch.empty_like(q)
    with torch.cuda.device(q.device):   # Triton launches on the current device, not the tensors'
        _paged_decode_kernel[(G, kv_heads)](
            q, k_pool, v_pool, table, lengths, out if sinks is None else sinks.contiguous(), out, scale,
            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
            table.stride(0), lengths.stride(0), out.stride(0), out.stride(1),
            GROUPS=groups, GP=max(16, triton.next_power_of_2(groups)), D=D, DP=max(16, triton.next_power_of_2(D)),
            IEEE=q.dtype == torch.float32, HAS_SINKS=sinks is not None, BN=BLOCK_N)
    return out

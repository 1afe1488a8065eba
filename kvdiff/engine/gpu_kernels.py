"""Triton kernels for exact numerics on CUDA: attention and RMSNorm, batch-invariant by construction.

Each program computes its rows with a fixed instruction sequence that does not depend on how
many rows are computed beside them: attention walks keys in fixed 64-key tiles aligned to
sequence position 0 with an online softmax (a fully masked tile leaves the running state
bit-for-bit unchanged), the tiles of each 256-key segment (aligned to position 0 too) into a
state of their own, merged into the row's state in position order; so a decode row's segments
can be computed side by side and merged afterwards with the same bits. RMSNorm reduces one row
per program. torch's own reductions and fp32 matmuls pick their strategy from the tensor's
shape, so their rows are not invariant on a GPU (benchmarks/gpu_invariance.py shows which are).

Imported only when exact numerics run on CUDA; Triton ships with CUDA builds of torch.
"""

from __future__ import annotations

import torch

from kvdiff.engine.row_tiles import CUDA_ROW_TILE, with_spare_rows
from kvdiff.errors import KvdiffError

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # a CUDA torch without Triton
    raise KvdiffError("exact numerics on CUDA need Triton (it ships with CUDA builds of torch): "
                      "install triton, or use --numerics fast") from exc

BLOCK_M = 64   # query rows per program
BLOCK_N = 64   # keys per tile: must equal exact_attention.KEY_TILE's alignment
KEY_SEGMENT = 256   # keys per segment, aligned to position 0: its tiles are folded into a state of their own


@triton.jit
def online_softmax_tile(q, k, v, visible, m_i, l_i, acc, scale, IEEE: tl.constexpr):
    """Fold one tile of keys into an online softmax: scores of rows `q` against `k`, where
    `visible`, update the running max `m_i`, sum `l_i` and output `acc` (all fp32). A fully
    masked tile leaves the state bit-for-bit unchanged. Shared by the exact attention kernel and
    the paged decode kernel (paged_kernel.py)."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def finish_softmax(m_i, l_i, acc, sink, HAS_SINKS: tl.constexpr):
    """The online softmax's output acc / l_i; with HAS_SINKS, each row's `sink` logit is one more
    term in its denominator (gpt-oss's attention sinks), both rescaled to the larger maximum.
    Shared by the exact attention kernel and the paged decode kernel."""
    if HAS_SINKS:
        top = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - top)
        return acc * alpha[:, None] / (l_i * alpha + tl.exp(sink - top))[:, None]
    return acc / l_i[:, None]


@triton.jit
def merge_segment(m_i, l_i, acc, m_s, l_s, acc_s):
    """Fold a segment's online-softmax state (`m_s`, `l_s`, `acc_s`) into the running one, in
    position order. A row the segment showed no key keeps its state bit for bit. Shared by the
    exact attention kernel and the exact decode's merge, so that both merge alike, and by the
    fast decode's merge of its key ranges (paged_kernel.py)."""
    top = tl.maximum(m_i, m_s)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    alpha, beta = tl.exp(m_i - top_safe), tl.exp(m_s - top_safe)
    saw = m_s != float("-inf")
    l_new = tl.where(saw, l_i * alpha + l_s * beta, l_i)
    acc_new = tl.where(saw[:, None], acc * alpha[:, None] + acc_s * beta[:, None], acc)
    return tl.where(saw, top, m_i), l_new, acc_new


# Triton compiles a variant per integer argument divisible by 16; the row and key counts, the
# diagonal and the mask's row stride vary from call to call, and a variant must never change a row's bits.
@triton.jit(do_not_specialize=["T", "L", "diagonal", "svis_t"])
def _attention_kernel(q_ptr, k_ptr, v_ptr, vis_ptr, sink_ptr, o_ptr, T, L, diagonal, scale,
                      sq_t, sq_h, sk_l, sk_h, sv_l, sv_h, svis_t, so_t, so_h,
                      GROUPS: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr, HAS_SINKS: tl.constexpr,
                      CAUSAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, SEG: tl.constexpr):
    block, head = tl.program_id(0), tl.program_id(1)
    kv_head = head // GROUPS
    rows = block * BM + tl.arange(0, BM)
    dims = tl.arange(0, D)
    q = tl.load(q_ptr + rows[:, None] * sq_t + head * sq_h + dims[None, :], mask=rows[:, None] < T, other=0.0)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, D), tl.float32)
    # CAUSAL: row i sees keys 0..i + diagonal, no mask is read, and the walk ends at the block's
    # last visible key: the tiles and segments past it would leave every row's state as it is.
    end = tl.minimum(L, block * BM + BM + diagonal) if CAUSAL else L
    for segment in range(0, end, SEG):
        m_s = tl.full((BM,), float("-inf"), tl.float32)
        l_s = tl.zeros((BM,), tl.float32)
        acc_s = tl.zeros((BM, D), tl.float32)
        for start in range(segment, tl.minimum(segment + SEG, end), BN):
            cols = start + tl.arange(0, BN)
            in_keys = cols < L
            if CAUSAL:
                vis = (cols[None, :] <= rows[:, None] + diagonal) & in_keys[None, :] & (rows[:, None] < T)
                seen = True
            else:
                vis = tl.load(vis_ptr + rows[:, None] * svis_t + cols[None, :],
                              mask=(rows[:, None] < T) & in_keys[None, :], other=0) != 0
                # A tile no row of the block sees would leave every row's state as it is (the fully
                # masked tile's no-op, which a row meets anyway past its last key): skipped, as the
                # CPU path skips it; that is half the tiles of a causal prefill.
                seen = tl.max(vis.to(tl.int32)) != 0
            if seen:
                k = tl.load(k_ptr + cols[:, None] * sk_l + kv_head * sk_h + dims[None, :], mask=in_keys[:, None],
                            other=0.0)
                v = tl.load(v_ptr + cols[:, None] * sv_l + kv_head * sv_h + dims[None, :], mask=in_keys[:, None],
                            other=0.0)
                m_s, l_s, acc_s = online_softmax_tile(q, k, v, vis, m_s, l_s, acc_s, scale, IEEE)
        m_i, l_i, acc = merge_segment(m_i, l_i, acc, m_s, l_s, acc_s)
    sink = 0.0
    if HAS_SINKS:
        sink = tl.load(sink_ptr + head).to(tl.float32)
    out = finish_softmax(m_i, l_i, acc, sink, HAS_SINKS)
    tl.store(o_ptr + rows[:, None] * so_t + head * so_h + dims[None, :], out.to(o_ptr.dtype.element_ty),
             mask=rows[:, None] < T)


# The exact kernel's walk for decode rows read through a slot table (a CUDA graph's step):
# program (row, KV head, segment) holds the row's query heads of that KV head in the first lanes
# of a 64-row block, the other lanes empty, as `attention` holds the rows of a prefill block (a
# row's bits do not depend on its lane or on the rows beside it), and folds the segment's
# position-aligned key tiles into a state of its own; _merge_segments_kernel then merges a row's
# segments in position order as `attention` does, so the row gets the bits `attention` gives it,
# and a long context's segments run side by side. Table column j holds the row's key at position j.
@triton.jit
def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, m_ptr, l_ptr, acc_ptr, scale, window,
                            sq_n, sq_h, sk_s, sk_h, sv_s, sv_h, st_n, sl_n,
                            H: tl.constexpr, SEGMENTS: tl.constexpr, GROUPS: tl.constexpr, D: tl.constexpr,
                            IEEE: tl.constexpr, WINDOWED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                            SEG: tl.constexpr):
    row, kv_head, segment = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    lanes = tl.arange(0, BM)
    alive = lanes < GROUPS
    heads = kv_head * GROUPS + lanes
    dims = tl.arange(0, D)
    q = tl.load(q_ptr + row * sq_n + heads[:, None] * sq_h + dims[None, :], mask=alive[:, None], other=0.0)
    length = tl.load(len_ptr + row * sl_n)
    m_s = tl.full((BM,), float("-inf"), tl.float32)
    l_s = tl.zeros((BM,), tl.float32)
    acc_s = tl.zeros((BM, D), tl.float32)
    first = segment * SEG
    last = tl.minimum(first + SEG, length)
    if WINDOWED:   # tiles wholly before the window are skipped: they would leave the state as it is
        first = tl.maximum(first, tl.maximum(length - window, 0) // BN * BN)
    for start in range(first, last, BN):
        cols = start + tl.arange(0, BN)
        in_keys = cols < length
        slots = tl.load(table_ptr + row * st_n + cols, mask=in_keys, other=0)
        k = tl.load(k_ptr + slots[:, None] * sk_s + kv_head * sk_h + dims[None, :], mask=in_keys[:, None], other=0.0)
        v = tl.load(v_ptr + slots[:, None] * sv_s + kv_head * sv_h + dims[None, :], mask=in_keys[:, None], other=0.0)
        vis = alive[:, None] & in_keys[None, :]
        if WINDOWED:
            vis = vis & (cols[None, :] >= length - window)
        m_s, l_s, acc_s = online_softmax_tile(q, k, v, vis, m_s, l_s, acc_s, scale, IEEE)
    state = (row * SEGMENTS + segment) * H + heads
    tl.store(m_ptr + state, m_s, mask=alive)
    tl.store(l_ptr + state, l_s, mask=alive)
    tl.store(acc_ptr + state[:, None] * D + dims[None, :], acc_s, mask=alive[:, None])


@triton.jit
def _merge_segments_kernel(m_ptr, l_ptr, acc_ptr, len_ptr, sink_ptr, o_ptr, sl_n, so_n, so_h,
                           H: tl.constexpr, SEGMENTS: tl.constexpr, GROUPS: tl.constexpr, D: tl.constexpr,
                           HAS_SINKS: tl.constexpr, BM: tl.constexpr, SEG: tl.constexpr):
    row, kv_head = tl.program_id(0), tl.program_id(1)
    lanes = tl.arange(0, BM)
    alive = lanes < GROUPS
    heads = kv_head * GROUPS + lanes
    dims = tl.arange(0, D)
    length = tl.load(len_ptr + row * sl_n)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, D), tl.float32)
    for segment in range(0, tl.cdiv(length, SEG)):
        state = (row * SEGMENTS + segment) * H + heads
        m_s = tl.load(m_ptr + state, mask=alive, other=float("-inf"))
        l_s = tl.load(l_ptr + state, mask=alive, other=0.0)
        acc_s = tl.load(acc_ptr + state[:, None] * D + dims[None, :], mask=alive[:, None], other=0.0)
        m_i, l_i, acc = merge_segment(m_i, l_i, acc, m_s, l_s, acc_s)
    sink = 0.0
    if HAS_SINKS:
        sink = tl.load(sink_ptr + heads, mask=alive, other=0.0).to(tl.float32)
    out = finish_softmax(m_i, l_i, acc, sink, HAS_SINKS)
    tl.store(o_ptr + row * so_n + heads[:, None] * so_h + dims[None, :], out.to(o_ptr.dtype.element_ty),
             mask=alive[:, None])


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                    lengths: torch.Tensor, window: int | None, scale: float,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention of decode rows, each the last of its sequence: q (G, H, D); pools (slots,
    KVH, D); table (G, Lmax) row i's key slots by position, rows of unit stride; lengths (G,);
    window: a sliding window's length or None; sinks (H,) or None. Returns (G, H, D) in q's
    dtype, each row with the bits `attention` gives it."""
    G, H, D = q.shape
    kv_heads = k_pool.shape[1]
    groups = H // kv_heads
    if groups > BLOCK_M:
        raise KvdiffError(f"exact decode holds a KV head's query heads in one {BLOCK_M}-row block; "
                          f"this model has {groups} query heads a KV head")
    q = _unit_last_stride(q)
    out = with_spare_rows(q.shape, q.dtype, q.device, CUDA_ROW_TILE)    # o_proj reads it next
    segments = max(1, -(-table.shape[1] // KEY_SEGMENT))     # from the table's width: a graph replays one grid
    maxima = torch.empty(G * segments * H, dtype=torch.float32, device=q.device)
    sums = torch.empty_like(maxima)
    partial = torch.empty(G * segments * H, D, dtype=torch.float32, device=q.device)
    with torch.cuda.device(q.device):
        _paged_attention_kernel[(G, kv_heads, segments)](
            q, k_pool, v_pool, table, lengths, maxima, sums, partial, scale, window or 0,
            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
            table.stride(0), lengths.stride(0), H=H, SEGMENTS=segments, GROUPS=groups, D=D,
            IEEE=q.dtype == torch.float32, WINDOWED=window is not None, BM=BLOCK_M, BN=BLOCK_N, SEG=KEY_SEGMENT)
        _merge_segments_kernel[(G, kv_heads)](
            maxima, sums, partial, lengths, out if sinks is None else sinks.contiguous(), out, lengths.stride(0),
            out.stride(0), out.stride(1), H=H, SEGMENTS=segments, GROUPS=groups, D=D, HAS_SINKS=sinks is not None,
            BM=BLOCK_M, SEG=KEY_SEGMENT)
    return out


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when its last dimension is dense: the kernels take the other strides as they
    are, so a transposed view (as transformers hands q, k, v over) needs no copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
              sinks: torch.Tensor | None = None, diagonal: int | None = None) -> torch.Tensor:
    """Exact attention of one sequence: q (T, H, D); k, v (L, KVH, D) with key j at position j;
    visible (T, L) bool; sinks (H,) per-head sink logits or None; `diagonal`: where the caller
    knows that row i sees exactly keys 0..i + diagonal (`visible` is then not read). Returns
    (T, H, D) in q's dtype."""
    T, H, D = q.shape
    L, KVH, _ = k.shape
    q, k, v, vis = (_unit_last_stride(t) for t in (q, k, v, visible))   # a bool mask loads as is
    out = with_spare_rows(q.shape, q.dtype, q.device, CUDA_ROW_TILE)    # o_proj reads it next
    # A tile past a row's last visible key is fully masked and leaves its state bit-for-bit
    # unchanged, so neither the number of keys nor the tiles a block skips change a row's bits.
    with torch.cuda.device(q.device):   # Triton launches on the current device, not the tensors'
        _attention_kernel[(-(-T // BLOCK_M), H)](
            q, k, v, vis, out if sinks is None else sinks.contiguous(), out, T, L, diagonal or 0, scale,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), vis.stride(0),
            out.stride(0), out.stride(1),
            GROUPS=H // KVH, D=D, IEEE=q.dtype == torch.float32, HAS_SINKS=sinks is not None,
            CAUSAL=diagonal is not None, BM=BLOCK_M, BN=BLOCK_N, SEG=KEY_SEGMENT)
    return out


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, H, sx, sy, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < H
    x = tl.load(x_ptr + row * sx + cols, mask=inside, other=0.0).to(tl.float32)
    normed = x * (1.0 / tl.sqrt_rn(tl.sum(x * x, 0) / H + eps))
    w = tl.load(w_ptr + cols, mask=inside, other=0.0)
    y = w * normed.to(x_ptr.dtype.element_ty)
    tl.store(y_ptr + row * sy + cols, y.to(y_ptr.dtype.element_ty), mask=inside)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, as transformers' Llama/Qwen RMSNorm computes it
    (fp32 statistics, normalised input cast back before the weight), one row per program."""
    H = x.shape[-1]
    rows = x.reshape(-1, H).contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = with_spare_rows(rows.shape, out_dtype, x.device, CUDA_ROW_TILE)    # a projection reads it next
    if rows.shape[0]:
        with torch.cuda.device(x.device):
            _rms_norm_kernel[(rows.shape[0],)](rows, weight.contiguous(), out, H, rows.stride(0), out.stride(0),
                                               float(eps), BLOCK=triton.next_power_of_2(H))
    return out.view(*x.shape[:-1], H)

"""Triton kernel for fast-numerics decode attention straight from the paged KV pool.

One program per (request, KV head) computes the query heads that share that KV head: it walks
the request's slot table in tiles of `BLOCK_N` keys, gathers their K and V rows from the pool
and keeps an online softmax. Where those programs are too few to fill the GPU (one long request,
or a cache hit's new turn over a long cached chunk), the keys are split as in flash-decoding:
each of `splits` programs per (request, KV head) walks its share of the tiles into a partial
state, and a second kernel merges the partial states. Used by `PagedDecode.attend` on CUDA;
`available` is False where Triton is missing, and the gather-and-SDPA path runs instead.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
    available = True
except ImportError:
    available = False
else:
    from kvdiff.engine.gpu_kernels import finish_softmax, merge_segment, online_softmax_tile

BLOCK_N = 64   # keys per tile
MAX_SPLITS = 16


if available:
    @triton.jit
    def _walk_tiles(q, k_ptr, v_ptr, slots_ptr, length, first, last, sk_s, sv_s, scale,
                    D: tl.constexpr, DP: tl.constexpr, GP: tl.constexpr, IEEE: tl.constexpr, BN: tl.constexpr):
        """The online softmax state (max, sum, output) of the query heads `q` over key tiles
        [first, last) of one row's slots (`k_ptr`/`v_ptr` at its KV head), keys past `length` masked."""
        dims = tl.arange(0, DP)
        m_i = tl.full((GP,), float("-inf"), tl.float32)
        l_i = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, DP), tl.float32)
        for tile in range(first, last):
            cols = tile * BN + tl.arange(0, BN)
            inside = cols < length
            slots = tl.load(slots_ptr + cols, mask=inside, other=0)
            kv_mask = inside[:, None] & (dims[None, :] < D)
            k = tl.load(k_ptr + slots[:, None] * sk_s + dims[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + slots[:, None] * sv_s + dims[None, :], mask=kv_mask, other=0.0)
            m_i, l_i, acc = online_softmax_tile(q, k, v, inside[None, :], m_i, l_i, acc, scale, IEEE)
        return m_i, l_i, acc

    @triton.jit
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, sink_ptr, o_ptr, m_ptr, l_ptr, acc_ptr, scale,
                             sq_n, sq_h, sk_s, sk_h, sv_s, sv_h, st_n, sl_n, so_n, so_h,
                             SPLITS: tl.constexpr, H: tl.constexpr, GROUPS: tl.constexpr, GP: tl.constexpr,
                             D: tl.constexpr, DP: tl.constexpr, IEEE: tl.constexpr, HAS_SINKS: tl.constexpr,
                             BN: tl.constexpr):
        """Program (row, KV head, split): the query heads of that KV head over the split's share of
        the row's key tiles. With one split the output itself; else the partial state, laid out
        (row, split, head), for _merge_splits_kernel."""
        row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        members = tl.arange(0, GP)
        heads = kv_head * GROUPS + members
        dims = tl.arange(0, DP)
        alive = members < GROUPS
        q_mask = alive[:, None] & (dims[None, :] < D)
        q = tl.load(q_ptr + row * sq_n + heads[:, None] * sq_h + dims[None, :], mask=q_mask, other=0.0)
        length = tl.load(len_ptr + row * sl_n)
        tiles = tl.cdiv(length, BN)
        per_split = tl.cdiv(tiles, SPLITS)
        first = split * per_split
        m_i, l_i, acc = _walk_tiles(q, k_ptr + kv_head * sk_h, v_ptr + kv_head * sv_h, table_ptr + row * st_n,
                                    length, first, tl.minimum(first + per_split, tiles), sk_s, sv_s, scale,
                                    D, DP, GP, IEEE, BN)
        if SPLITS == 1:
            sink = 0.0
            if HAS_SINKS:
                sink = tl.load(sink_ptr + heads, mask=alive, other=0.0).to(tl.float32)
            out = finish_softmax(m_i, l_i, acc, sink, HAS_SINKS)
            tl.store(o_ptr + row * so_n + heads[:, None] * so_h + dims[None, :], out.to(o_ptr.dtype.element_ty),
                     mask=q_mask)
        else:
            state = (row * SPLITS + split) * H + heads
            tl.store(m_ptr + state, m_i, mask=alive)
            tl.store(l_ptr + state, l_i, mask=alive)
            tl.store(acc_ptr + state[:, None] * DP + dims[None, :], acc, mask=alive[:, None])

    @triton.jit
    def _merge_splits_kernel(m_ptr, l_ptr, acc_ptr, sink_ptr, o_ptr, so_n, so_h,
                             SPLITS: tl.constexpr, H: tl.constexpr, GROUPS: tl.constexpr, GP: tl.constexpr,
                             D: tl.constexpr, DP: tl.constexpr, HAS_SINKS: tl.constexpr):
        row, kv_head = tl.program_id(0), tl.program_id(1)
        members = tl.arange(0, GP)
        heads = kv_head * GROUPS + members
        dims = tl.arange(0, DP)
        alive = members < GROUPS
        m_all = tl.full((GP,), float("-inf"), tl.float32)
        l_all = tl.zeros((GP,), tl.float32)
        acc_all = tl.zeros((GP, DP), tl.float32)
        for split in range(SPLITS):
            state = (row * SPLITS + split) * H + heads
            m_s = tl.load(m_ptr + state, mask=alive, other=float("-inf"))
            l_s = tl.load(l_ptr + state, mask=alive, other=0.0)
            acc_s = tl.load(acc_ptr + state[:, None] * DP + dims[None, :], mask=alive[:, None], other=0.0)
            m_all, l_all, acc_all = merge_segment(m_all, l_all, acc_all, m_s, l_s, acc_s)
        sink = 0.0
        if HAS_SINKS:
            sink = tl.load(sink_ptr + heads, mask=alive, other=0.0).to(tl.float32)
        out = finish_softmax(m_all, l_all, acc_all, sink, HAS_SINKS)
        tl.store(o_ptr + row * so_n + heads[:, None] * so_h + dims[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=alive[:, None] & (dims[None, :] < D))


@functools.cache
def _processors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def key_splits(programs: int, device: torch.device) -> int:
    """How many key ranges each of `programs` (request, KV head) pairs is split into: none where
    they fill the GPU's processors, else enough to fill them about twice. From the grid alone, as
    a CUDA graph replays it for any lengths. Measured on an H100 (docs/gpu.md): a batch-1 step's
    attention over 7,900 keys 9x faster, a 26-row turn over 2,481 keys of the 135M shape 1.9x."""
    processors = _processors(device)
    if programs >= processors:
        return 1
    return min(MAX_SPLITS, -(-2 * processors // programs))


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                 lengths: torch.Tensor, scale: float, sinks: torch.Tensor | None = None,
                 splits: int | None = None) -> torch.Tensor:
    """Attention of one row per request: q (G, H, D); pools (slots, KVH, D), contiguous; table
    (G, Lmax) slots, rows of unit stride; lengths (G,) keys per row (at least one), any stride;
    sinks (H,) per-head sink logits or None; `splits` key ranges per (request, KV head), by
    default `key_splits`. Returns (G, H, D) in q's dtype."""
    G, H, D = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    kv_heads = k_pool.shape[1]
    groups = H // kv_heads
    if splits is None:
        # From the grid alone, eager or in a graph: a probed run's eager steps keep the bits of
        # the graphed steps it stands in for (at ~60 us more host time a layer, the merge's launch).
        splits = key_splits(G * kv_heads, q.device)
    shapes = dict(GROUPS=groups, GP=max(16, triton.next_power_of_2(groups)), D=D,
                  DP=max(16, triton.next_power_of_2(D)))
    out = torch.empty_like(q)
    sink_ptr = out if sinks is None else sinks.contiguous()
    strides = (q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
               table.stride(0), lengths.stride(0), out.stride(0), out.stride(1))
    # The splits' partial states (max, sum, output); one split writes the output alone, its
    # partial-state stores compiled out, and `out` stands in for their pointers.
    maxima = sums = partial = out
    if splits > 1:
        maxima = torch.empty(G * splits * H, dtype=torch.float32, device=q.device)
        sums = torch.empty_like(maxima)
        partial = torch.empty(G * splits * H, shapes["DP"], dtype=torch.float32, device=q.device)
    with torch.cuda.device(q.device):   # Triton launches on the current device, not the tensors'
        _paged_decode_kernel[(G, kv_heads, splits)](
            q, k_pool, v_pool, table, lengths, sink_ptr, out, maxima, sums, partial, scale, *strides,
            SPLITS=splits, H=H, IEEE=q.dtype == torch.float32, HAS_SINKS=sinks is not None, BN=BLOCK_N, **shapes)
        if splits > 1:
            _merge_splits_kernel[(G, kv_heads)](maxima, sums, partial, sink_ptr, out, out.stride(0), out.stride(1),
                                                SPLITS=splits, H=H, HAS_SINKS=sinks is not None, **shapes)
    return out

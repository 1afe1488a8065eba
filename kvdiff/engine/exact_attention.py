"""Exact attention by torch calls (the CPU's, and a GPU's for head widths its kernel does not take):
keys in fixed 64-key tiles aligned to position 0, folded into an online softmax in tile order, so a
query at position p gets the same bits in a prefill, a chunked prefill or a decode step (see
numerics.py). Query rows go in blocks of QUERY_BLOCK, each walking the tiles it reaches; a decode
step's few rows on the CPU take every tile at once, where a probe finds that gives the loop's bits.
"""

from __future__ import annotations

import logging

import torch

from kvdiff.engine.cpu_linear import ROW_TILE as CPU_ROW_TILE
from kvdiff.engine.row_tiles import CUDA_ROW_TILE

log = logging.getLogger(__name__)

KEY_TILE = 64          # attention: keys in tiles of this many positions, aligned to position 0
QUERY_BLOCK = 128      # CPU attention: query rows per block (a multiple of both row tiles)
ALL_TILES_AT_ONCE = 3  # CPU: a decode step's rows over this many key tiles or more take them at once


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                    scale: float, sinks: torch.Tensor | None = None, diagonal: int | None = None) -> torch.Tensor:
    """Batch-invariant attention of one sequence.

    q (T, H, D); k, v (L, KVH, D) with key j at sequence position j (or j plus a multiple of
    KEY_TILE); visible (T, L) bool; sinks (H,): per-head sink logits, one more term in each row's
    softmax denominator (gpt-oss), or None; `diagonal`: where `visible` is known to show row i
    exactly keys 0..i + diagonal (the CUDA kernel then computes the mask instead of reading it).
    Returns (T, H, D) in q's dtype. Computed in float32.
    """
    T, H, D = q.shape
    Dv = v.shape[-1]      # the values' width (MLA's differs from the keys')
    if q.is_cuda and D & (D - 1) == 0 and Dv == D:
        from kvdiff.engine import gpu_kernels

        return gpu_kernels.attention(q, k, v, visible, scale, sinks, diagonal)
    # a decode step's few rows on the CPU over many key tiles: every tile at once, where that is probed to
    # give the loop's bits
    at_once = (T <= CPU_ROW_TILE and q.device.type == "cpu" and -(-k.shape[0] // KEY_TILE) >= ALL_TILES_AT_ONCE
               and _at_once_agrees(k.shape[1], H // k.shape[1], D, Dv))
    return _tiled_attention(q, k, v, visible, scale, sinks, at_once)


def _tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
                     sinks: torch.Tensor | None, at_once: bool) -> torch.Tensor:
    """`exact_attention` by torch calls: query blocks walk their key tiles in a loop, or (`at_once`, a
    block of CPU_ROW_TILE padded rows) take them all at once."""
    T, H, D = q.shape
    Dv = v.shape[-1]
    L, KVH, _ = k.shape
    groups = H // KVH
    multiple = CUDA_ROW_TILE if q.device.type == "cuda" else CPU_ROW_TILE
    Tp = -(-T // multiple) * multiple
    ntiles = -(-L // KEY_TILE)
    Lp = ntiles * KEY_TILE
    qf = q.new_zeros((Tp, H, D), dtype=torch.float32)
    qf[:T] = q
    qf = qf.view(Tp, KVH, groups, D).permute(1, 0, 2, 3).reshape(KVH, Tp * groups, D)     # row t * groups + g
    kf = k.new_zeros((KVH, Lp, D), dtype=torch.float32)
    kf[:, :L] = k.permute(1, 0, 2)
    vf = v.new_zeros((KVH, Lp, Dv), dtype=torch.float32)
    vf[:, :L] = v.permute(1, 0, 2)
    vis = torch.zeros((Tp, Lp), dtype=torch.bool, device=q.device)
    vis[:T, :L] = visible
    hidden = ~vis.unsqueeze(1).expand(Tp, groups, Lp).reshape(Tp * groups, Lp)
    # A key tile hidden from every row of a block leaves those rows' state bit-for-bit unchanged
    # (scores -inf: alpha 1, p 0), so each block skips such tiles (half of a causal prefill).
    reaches = vis.view(Tp, ntiles, KEY_TILE).any(-1)
    sink_rows = None if sinks is None else \
        sinks.float().to(q.device).view(KVH, 1, groups).expand(KVH, Tp, groups).reshape(KVH, Tp * groups, 1)
    if at_once:
        out = _all_tiles_at_once(qf, kf, vf, hidden, reaches, scale, sink_rows, T * groups)
        out = out.view(KVH, T, groups, Dv).permute(1, 0, 2, 3).reshape(T, H, Dv)
        return out.to(q.dtype)
    out = torch.empty((KVH, Tp * groups, Dv), device=q.device)
    for first in range(0, Tp, QUERY_BLOCK):
        rows = slice(first * groups, min(Tp, first + QUERY_BLOCK) * groups)
        out[:, rows] = _online_softmax(qf[:, rows], kf, vf, hidden[rows], reaches[first:first + QUERY_BLOCK], scale,
                                       None if sink_rows is None else sink_rows[:, rows])
    out = out.view(KVH, Tp, groups, Dv).permute(1, 0, 2, 3).reshape(Tp, H, Dv)
    return out[:T].to(q.dtype)


def _online_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor,
                    reaches: torch.Tensor, scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention of one block of rows over the key tiles any of them can see, in key order; `sinks`
    (kvh, n, 1): each row's sink logit, folded into the denominator after the last tile."""
    neg_inf = float("-inf")
    kvh, n, _ = q.shape
    m = torch.full((kvh, n, 1), neg_inf, device=q.device)
    l = torch.zeros((kvh, n, 1), device=q.device)
    acc = torch.zeros((kvh, n, v.shape[-1]), device=q.device)
    for t in torch.nonzero(reaches.any(0)).flatten().tolist():
        cols = slice(t * KEY_TILE, (t + 1) * KEY_TILE)
        s = torch.bmm(q, k[:, cols].transpose(1, 2)) * scale
        s = s.masked_fill(hidden[:, cols], neg_inf)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        m_safe = m_new.masked_fill(m_new == neg_inf, 0.0)
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe)
        l = l * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.bmm(p, v[:, cols])
        m = m_new
    return _finished(acc, l, m, sinks)


def _finished(acc: torch.Tensor, l: torch.Tensor, m: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The online softmax's output from its running output, sum and max; `sinks` (kvh, n, 1): each
    row's sink logit, one more term in the denominator, both rescaled to the larger maximum."""
    if sinks is None:
        return acc / l
    top = torch.maximum(m, sinks)
    alpha = torch.exp(m - top)
    return acc * alpha / (l * alpha + torch.exp(sinks - top))


_AT_ONCE_AGREES: dict[tuple[int, int, int, int], bool] = {}


def _at_once_agrees(kvh: int, groups: int, d: int, dv: int) -> bool:
    """Whether every key tile at once gives a decode row the loop's bits for these head shapes:
    probed once a process on random rows over 3 and 40 tiles, as the two forms' matmuls differ in
    shape and their bits are MKL's choice, not its promise."""
    key = (kvh, groups, d, dv)
    known = _AT_ONCE_AGREES.get(key)
    if known is None:
        gen = torch.Generator().manual_seed(0)
        known = True
        for keys in (3 * KEY_TILE - 5, 40 * KEY_TILE):
            q = torch.randn((2, kvh * groups, d), generator=gen)
            k, v = torch.randn((keys, kvh, d), generator=gen), torch.randn((keys, kvh, dv), generator=gen)
            visible = torch.arange(keys) <= torch.tensor([[keys - 2], [keys - 1]])
            known = known and torch.equal(_tiled_attention(q, k, v, visible, d ** -0.5, None, True),
                                          _tiled_attention(q, k, v, visible, d ** -0.5, None, False))
        if not known:
            log.debug("a decode row over every key tile at once differs from the loop for heads %s: the loop", key)
        _AT_ONCE_AGREES[key] = known
    return known


def _all_tiles_at_once(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor,
                       reaches: torch.Tensor, scale: float, sinks: torch.Tensor | None, real: int) -> torch.Tensor:
    """`_online_softmax` of one block of CPU_ROW_TILE padded rows whose first `real` rows matter (a
    decode step's), every key tile it reaches at once: the scores' and the values' matmuls keep the
    padded block's shape, on which a row's bits depend (not on the other rows' values), everything
    else reads the real rows only, and the tiles are folded into the running sum and output in key
    order, as the loop folds them. So each real row gets the loop's bits (tests/test_engine_units.py
    compares the two) in a dozen calls instead of a dozen a tile; (kvh, real, Dv)."""
    neg_inf = float("-inf")
    kvh, n, d = q.shape
    dv, width = v.shape[-1], k.shape[1] // KEY_TILE
    tiles = torch.nonzero(reaches.any(0)).flatten()
    m = torch.full((kvh, real, 1), neg_inf, device=q.device)
    l = torch.zeros((kvh, real, 1), device=q.device)
    acc = torch.zeros((kvh, real, dv), device=q.device)
    count = tiles.numel()
    if count:
        kt, vt, shut = k.view(kvh, width, KEY_TILE, d), v.view(kvh, width, KEY_TILE, dv), \
            hidden[:real].view(real, width, KEY_TILE)
        if count < width:          # (a window's rows): only the tiles they reach
            kt, vt, shut = kt.index_select(1, tiles), vt.index_select(1, tiles), shut.index_select(1, tiles)
        kt, vt = kt.reshape(kvh, count * KEY_TILE, d), vt.reshape(kvh * count, KEY_TILE, dv)
        s = torch.bmm(q, kt.transpose(1, 2))[:, :real] * scale
        s = s.view(kvh, real, count, KEY_TILE).masked_fill(shut, neg_inf)
        m_after = torch.cummax(s.amax(-1), -1).values                       # the running max after each tile
        m_before = torch.cat([m, m_after[..., :-1]], -1)
        m_safe = m_after.masked_fill(m_after == neg_inf, 0.0)
        alpha = torch.exp(m_before - m_safe).unsqueeze(-1)
        p = torch.exp(s - m_safe.unsqueeze(-1))
        sums = p.sum(-1, keepdim=True)
        padded = p.new_zeros((kvh, count, n, KEY_TILE))
        padded[:, :, :real] = p.transpose(1, 2)
        pv = torch.bmm(padded.view(kvh * count, n, KEY_TILE), vt).view(kvh, count, n, dv)[:, :, :real]
        for t in range(count):
            l = l * alpha[:, :, t] + sums[:, :, t]
            acc = acc * alpha[:, :, t] + pv[:, t]
        m = m_after[..., -1:]
    return _finished(acc, l, m, None if sinks is None else sinks[:, :real])

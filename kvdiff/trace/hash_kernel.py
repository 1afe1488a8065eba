"""Triton kernels: the weight hash of `model_meta.gpu_weight_digests`, and digest.row_digests on
a GPU, each in one pass over the words.

The torch form of the hash widens every word to int64 and runs a dozen elementwise kernels over
it: 0.09-0.15 s for the 1.2 billion weights of a 1B model on an H100. This kernel reads each
word once and mixes it in registers with the same integer arithmetic, so both give the same
sums; with it the 1B model's whole fingerprint takes 0.012 s.
The row digests' torch form is about ten kernels a capture, and a prefill hands over hundreds
of captures: the launches cost more host time than the rows take to read. `row_digests` is one
launch. `available` is False where Triton is missing, and the torch forms run instead.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    available = True
except ImportError:
    available = False

BLOCK = 4096   # words per program; each program writes one partial sum
ROW_WORDS = 512   # a row's 64-bit words read per step of its program


if available:
    @triton.jit
    def _mixed_sum_kernel(words_ptr, partial_ptr, n, MUL1: tl.constexpr, MUL2: tl.constexpr,
                          MUL3: tl.constexpr, BLOCK: tl.constexpr):
        block = tl.program_id(0).to(tl.int64)
        index = block * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        inside = index < n
        x = tl.load(words_ptr + index, mask=inside, other=0).to(tl.int64) * MUL1 + index * MUL2
        x = x ^ (x >> 31)
        x = x * MUL3
        x = x ^ (x >> 29)
        tl.store(partial_ptr + block, tl.sum(tl.where(inside, x, 0), axis=0))


def mixed_word_sum(words: torch.Tensor, mul1: int, mul2: int, mul3: int) -> torch.Tensor:
    """Sum (int64, wrapping) of every word of the contiguous 1-D integer tensor `words` on a GPU,
    each mixed with its index: x = w * mul1 + i * mul2; x ^= x >> 31; x *= mul3; x ^= x >> 29."""
    n = words.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.int64, device=words.device)
    partial = torch.empty(triton.cdiv(n, BLOCK), dtype=torch.int64, device=words.device)
    with torch.cuda.device(words.device):
        _mixed_sum_kernel[(partial.numel(),)](words, partial, n, mul1, mul2, mul3, BLOCK)
    return partial.sum()


if available:
    @triton.jit
    def _row_digest_kernel(x_ptr, mult_ptr, hash_ptr, stats_ptr, width, row_stride, inv_sqrt_width,
                           WORDS: tl.constexpr, WIDENED: tl.constexpr, CANONICAL_NAN: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * row_stride
        n_words = (width + 1) // 2
        total = tl.zeros([WORDS], dtype=tl.int64)
        squares = tl.zeros([WORDS], dtype=tl.float64)
        largest = tl.zeros([WORDS], dtype=tl.float32)
        for start in range(0, n_words, WORDS):
            k = start + tl.arange(0, WORDS).to(tl.int64)
            lo = tl.load(base + 2 * k, mask=2 * k < width, other=0.0).to(tl.float32)
            hi = tl.load(base + 2 * k + 1, mask=2 * k + 1 < width, other=0.0).to(tl.float32)
            lo_bits, hi_bits = lo.to(tl.int32, bitcast=True), hi.to(tl.int32, bitcast=True)
            if WIDENED:     # a 16-bit NaN's payload widens differently on each device: one NaN
                lo_bits = tl.where(lo != lo, CANONICAL_NAN, lo_bits)
                hi_bits = tl.where(hi != hi, CANONICAL_NAN, hi_bits)
            word = (lo_bits.to(tl.int64) & 0xFFFFFFFF) | (hi_bits.to(tl.int64) << 32)
            total += word * tl.load(mult_ptr + k, mask=k < n_words, other=0)
            squares += lo.to(tl.float64) * lo.to(tl.float64) + hi.to(tl.float64) * hi.to(tl.float64)
            largest = tl.maximum(largest, tl.maximum(tl.abs(lo), tl.abs(hi)))
        square_sum = tl.sum(squares, axis=0)
        tl.store(hash_ptr + row, tl.sum(total, axis=0))
        tl.store(stats_ptr + 2 * row, (tl.sqrt(square_sum) * inv_sqrt_width).to(tl.float32))
        # a NaN element makes the sum of squares NaN (and only one does): max_abs is NaN too, as in torch
        largest_abs = tl.max(largest, axis=0)
        tl.store(stats_ptr + 2 * row + 1, tl.where(square_sum != square_sum, square_sum.to(tl.float32), largest_abs))


def row_digests(flat: torch.Tensor, multipliers: torch.Tensor, canonical_nan: int) -> tuple[torch.Tensor, torch.Tensor]:
    """digest.row_digests of the float rows `flat` (T, W) on a GPU in one launch: each row's
    elements widened to float32 (a 16-bit NaN as `canonical_nan`), read as little-endian 64-bit words (the last zero-padded) and
    summed times `multipliers` (one per word); rms and max_abs beside it."""
    if flat.stride(1) != 1:
        flat = flat.contiguous()
    rows, width = flat.shape
    hashes = torch.empty(rows, dtype=torch.int64, device=flat.device)
    stats = torch.empty(rows, 2, dtype=torch.float32, device=flat.device)
    if rows:
        with torch.cuda.device(flat.device):
            _row_digest_kernel[(rows,)](flat, multipliers, hashes, stats, width, flat.stride(0), width ** -0.5,
                                        WORDS=ROW_WORDS, WIDENED=flat.element_size() == 2,
                                        CANONICAL_NAN=canonical_nan)
    return hashes, stats

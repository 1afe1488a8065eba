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
PART_WORDS = 4096     # a wide row's words per program, where its rows are few
SPLIT_BELOW_ROWS = 64     # rows fewer than this are split in parts (more rows fill the GPU as they are)


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
    def _digest_words(base, width, start, end, mult_ptr, WORDS: tl.constexpr, WIDENED: tl.constexpr,
                      CANONICAL_NAN: tl.constexpr):
        """The words start..end of the row at `base`: their hash sum, square sum and largest |x|."""
        total = tl.zeros([WORDS], dtype=tl.int64)
        squares = tl.zeros([WORDS], dtype=tl.float64)
        largest = tl.zeros([WORDS], dtype=tl.float32)
        for first in range(start, end, WORDS):
            k = first + tl.arange(0, WORDS).to(tl.int64)
            lo = tl.load(base + 2 * k, mask=(2 * k < width) & (k < end), other=0.0).to(tl.float32)
            hi = tl.load(base + 2 * k + 1, mask=(2 * k + 1 < width) & (k < end), other=0.0).to(tl.float32)
            lo_bits, hi_bits = lo.to(tl.int32, bitcast=True), hi.to(tl.int32, bitcast=True)
            if WIDENED:     # a 16-bit NaN's payload widens differently on each device: one NaN
                lo_bits = tl.where(lo != lo, CANONICAL_NAN, lo_bits)
                hi_bits = tl.where(hi != hi, CANONICAL_NAN, hi_bits)
            word = (lo_bits.to(tl.int64) & 0xFFFFFFFF) | (hi_bits.to(tl.int64) << 32)
            total += word * tl.load(mult_ptr + k, mask=k < end, other=0)
            squares += lo.to(tl.float64) * lo.to(tl.float64) + hi.to(tl.float64) * hi.to(tl.float64)
            largest = tl.maximum(largest, tl.maximum(tl.abs(lo), tl.abs(hi)))
        return tl.sum(total, axis=0), tl.sum(squares, axis=0), tl.max(largest, axis=0)

    @triton.jit
    def _store_digest(hash_ptr, stats_ptr, at, total, square_sum, largest_abs, inv_sqrt_width):
        tl.store(hash_ptr + at, total)
        tl.store(stats_ptr + 2 * at, (tl.sqrt(square_sum) * inv_sqrt_width).to(tl.float32))
        tl.store(stats_ptr + 2 * at + 1, tl.where(square_sum != square_sum, square_sum.to(tl.float32), largest_abs))

    @triton.jit
    def _row_digest_kernel(x_ptr, mult_ptr, hash_ptr, stats_ptr, squares_ptr, largest_ptr, width, row_stride,
                           inv_sqrt_width, part_words, WORDS: tl.constexpr, WIDENED: tl.constexpr,
                           CANONICAL_NAN: tl.constexpr, WHOLE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        part, parts = tl.program_id(1).to(tl.int64), tl.num_programs(1)
        n_words = (width + 1) // 2
        total, square_sum, largest_abs = _digest_words(x_ptr + row * row_stride, width, part * part_words,
                                                       tl.minimum(n_words, (part + 1) * part_words), mult_ptr,
                                                       WORDS, WIDENED, CANONICAL_NAN)
        if WHOLE:
            _store_digest(hash_ptr, stats_ptr, row, total, square_sum, largest_abs, inv_sqrt_width)
        else:       # one part of the row's words: partial sums, which the caller adds
            at = row * parts + part
            tl.store(hash_ptr + at, total)
            tl.store(squares_ptr + at, square_sum)
            tl.store(largest_ptr + at, largest_abs)

    @triton.jit
    def _gathered_digest_kernel(bases_ptr, slots_ptr, mult_ptr, hash_ptr, stats_ptr, width, row_stride,
                                inv_sqrt_width, DTYPE: tl.constexpr, WORDS: tl.constexpr,
                                WIDENED: tl.constexpr, CANONICAL_NAN: tl.constexpr):
        row, table = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        base = tl.load(bases_ptr + table).to(tl.pointer_type(DTYPE)) + tl.load(slots_ptr + row) * row_stride
        total, square_sum, largest_abs = _digest_words(base, width, 0, (width + 1) // 2, mult_ptr, WORDS, WIDENED,
                                                       CANONICAL_NAN)
        _store_digest(hash_ptr, stats_ptr, row * tl.num_programs(1) + table, total, square_sum, largest_abs,
                      inv_sqrt_width)


TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16} if available else {}


def gathered_row_digests(tables: list[torch.Tensor], bases: torch.Tensor, slots: torch.Tensor,
                         multipliers: torch.Tensor, canonical_nan: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`row_digests` of the rows at `slots` of each of `tables` (tensors of one dtype, row shape
    and row stride, each row's elements contiguous: a KV cache's layers) in one launch, without
    copying the rows out: hashes (len(slots), len(tables)) and statistics (..., 2). `bases` holds
    the tables' addresses (int64, on their device; made by the caller, once)."""
    first = tables[0]
    width = first[0].numel()
    hashes = torch.empty(slots.numel(), len(tables), dtype=torch.int64, device=first.device)
    stats = torch.empty(slots.numel(), len(tables), 2, dtype=torch.float32, device=first.device)
    with torch.cuda.device(first.device):
        _gathered_digest_kernel[(slots.numel(), len(tables))](
            bases, slots, multipliers, hashes, stats, width, first.stride(0), width ** -0.5,
            DTYPE=TRITON_DTYPES[first.dtype],
            WORDS=ROW_WORDS, WIDENED=first.element_size() == 2, CANONICAL_NAN=canonical_nan)
    return hashes, stats


def row_digests(flat: torch.Tensor, multipliers: torch.Tensor, canonical_nan: int) -> tuple[torch.Tensor, torch.Tensor]:
    """digest.row_digests of the float rows `flat` (T, W) on a GPU: each row's elements widened
    to float32 (a 16-bit NaN as `canonical_nan`), read as little-endian 64-bit words (the last
    zero-padded) and summed times `multipliers` (one per word); rms and max_abs beside it. One
    launch where the rows are many or narrow; a few rows of more than PART_WORDS words (a
    decode step's logits) are split among programs, whose partial sums are then added."""
    if flat.stride(1) != 1:
        flat = flat.contiguous()
    rows, width = flat.shape
    n_words = (width + 1) // 2
    parts = triton.cdiv(n_words, PART_WORDS) if rows < SPLIT_BELOW_ROWS else 1
    hashes = torch.empty(rows, dtype=torch.int64, device=flat.device)
    stats = torch.empty(rows, 2, dtype=torch.float32, device=flat.device)
    if not rows:
        return hashes, stats
    part_hashes, squares, largest = hashes, stats, stats      # unused when one program takes a whole row
    if parts > 1:
        part_hashes = torch.empty(rows, parts, dtype=torch.int64, device=flat.device)
        squares = torch.empty(rows, parts, dtype=torch.float64, device=flat.device)
        largest = torch.empty(rows, parts, dtype=torch.float32, device=flat.device)
    with torch.cuda.device(flat.device):
        _row_digest_kernel[(rows, parts)](flat, multipliers, part_hashes, stats, squares, largest, width,
                                          flat.stride(0), width ** -0.5, n_words if parts == 1 else PART_WORDS,
                                          WORDS=ROW_WORDS, WIDENED=flat.element_size() == 2,
                                          CANONICAL_NAN=canonical_nan, WHOLE=parts == 1)
    if parts > 1:
        torch.sum(part_hashes, 1, out=hashes)
        square_sum = squares.sum(1)
        torch.mul(square_sum.sqrt(), width ** -0.5, out=stats[:, 0])
        torch.where(square_sum.isnan(), square_sum.float(), largest.amax(1), out=stats[:, 1])
    return hashes, stats

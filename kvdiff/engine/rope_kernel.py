"""Triton kernel for the engine's RoPE on CUDA: one kernel where `apply_rope` launches five.

`apply_rope(x, cos, sin)` is x * cos + rotate_half(x) * sin: a product, a negation, a
concatenation, a product and a sum, each a kernel, for q and again for k, every layer. A decode
step is bound by such small kernels nearly as much as by the weights, so the engine rotates each
of q and k in one kernel. Fast numerics compute in float32 with one rounding; exact numerics
(`rounded`, bfloat16) round every product and the sum to bfloat16, as torch's kernels do one
after another, so the rows keep transformers' bits. `available` is False where Triton is
missing.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    available = True
except ImportError:
    available = False


if available:
    @triton.jit
    def _to_bfloat16(x):
        """float32 `x` rounded to bfloat16 (to nearest, ties to even), as float32: by its bits,
        which the compiler cannot fold into a fused multiply-add as it folds a cast there and back."""
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, o_ptr, sx_t, sx_h, sc_t, ss_t, so_t, so_h,
                     HALF: tl.constexpr, BLOCK: tl.constexpr, ROUNDED: tl.constexpr):
        t, h = tl.program_id(0), tl.program_id(1)
        i = tl.arange(0, BLOCK)
        inside = i < HALF
        x = x_ptr + t * sx_t + h * sx_h
        x1 = tl.load(x + i, mask=inside, other=0.0).to(tl.float32)
        x2 = tl.load(x + HALF + i, mask=inside, other=0.0).to(tl.float32)
        c1 = tl.load(cos_ptr + t * sc_t + i, mask=inside, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + t * sc_t + HALF + i, mask=inside, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + t * ss_t + i, mask=inside, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + t * ss_t + HALF + i, mask=inside, other=0.0).to(tl.float32)
        o = o_ptr + t * so_t + h * so_h
        dtype = o_ptr.dtype.element_ty
        if ROUNDED:     # each (exact) product rounded as its own kernel would, then the sum
            first = _to_bfloat16(_to_bfloat16(x1 * c1) - _to_bfloat16(x2 * s1))
            second = _to_bfloat16(_to_bfloat16(x2 * c2) + _to_bfloat16(x1 * s2))
        else:
            first, second = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
        tl.store(o + i, first.to(dtype), mask=inside)
        tl.store(o + HALF + i, second.to(dtype), mask=inside)


def rounds_like_torch(*tensors: torch.Tensor) -> bool:
    """Whether `rotate(..., rounded=True)` gives `apply_rope`'s bits for these rows and cos/sin:
    all bfloat16 (a product of two bfloat16 values is exact in float32, so rounding it to
    bfloat16 is what torch's kernel does; float16 and float32 rows keep apply_rope)."""
    return all(t.dtype == torch.bfloat16 for t in tensors)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rounded: bool = False) -> torch.Tensor:
    """`apply_rope(x, cos, sin)` in one kernel: rows x (T, heads, D), cos/sin (T, D), each with
    a dense last dimension; `rounded`: with `apply_rope`'s bits (where `rounds_like_torch`).
    Returns a new (T, heads, D) tensor in x's dtype."""
    T, H, D = x.shape
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T:
        with torch.cuda.device(x.device):
            _rope_kernel[(T, H)](x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
                                 out.stride(0), out.stride(1), HALF=D // 2, BLOCK=triton.next_power_of_2(D // 2),
                                 ROUNDED=rounded)
    return out

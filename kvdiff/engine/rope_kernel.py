"""Triton kernel for fast numerics' RoPE on CUDA: one kernel where `apply_rope` launches five.

`apply_rope(x, cos, sin)` is x * cos + rotate_half(x) * sin: a product, a negation, a
concatenation, a product and a sum, each a kernel, for q and again for k, every layer. A decode
step is bound by such small kernels nearly as much as by the weights, so the engine's fast
numerics rotate each of q and k in one kernel, in float32 with one rounding (fast numerics
promise no bits; exact numerics keep `apply_rope`, transformers' own arithmetic).
`available` is False where Triton is missing.
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
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, o_ptr, sx_t, sx_h, sc_t, ss_t, so_t, so_h,
                     HALF: tl.constexpr, BLOCK: tl.constexpr):
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
        tl.store(o + i, (x1 * c1 - x2 * s1).to(o_ptr.dtype.element_ty), mask=inside)
        tl.store(o + HALF + i, (x2 * c2 + x1 * s2).to(o_ptr.dtype.element_ty), mask=inside)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope(x, cos, sin)` in one kernel: rows x (T, heads, D), cos/sin (T, D), each with
    a dense last dimension. Returns a new (T, heads, D) tensor in x's dtype."""
    T, H, D = x.shape
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T:
        with torch.cuda.device(x.device):
            _rope_kernel[(T, H)](x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
                                 out.stride(0), out.stride(1), HALF=D // 2, BLOCK=triton.next_power_of_2(D // 2))
    return out

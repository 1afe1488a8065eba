"""The paged cache of multi-head latent attention (MLA, DeepSeek-V2/V3): a latent and a RoPE key per token.

MLA caches no per-head K and V. Each token leaves two rows per layer: the compressed latent
(kv_a_proj_with_mqa's first kv_lora_rank columns through kv_a_layernorm) and one RoPE key of
qk_rope_head_dim columns, rotated, shared by every head. Attention expands them where it reads:
kv_b_proj turns each latent into every head's K part without position (qk_nope_head_dim) and its
V (v_head_dim), and every head's key is that part followed by the shared RoPE key, exactly as
transformers' DeepseekV3Attention.expand_kv builds it, so the expanded rows carry the reference's
bits.

`LatentPool` is a BlockPool whose `k` pools hold the RoPE keys (n, 1, qk_rope_head_dim) and whose
`v` pools hold the latents (n, kv_lora_rank): blocks, slots, writes and the rows the cache holds
(`rows`: what the trace records, what re-rotation turns) are the BlockPool's; `read`, what
attention reads, is the expansion. A latent of 512 and a key of 64 per token and layer are 576
values where K and V of DeepSeek-V3's 128 heads would be 40,960.
"""

from __future__ import annotations

import torch
from torch import nn

from kvdiff.engine.kv_cache import BLOCK_SIZE, BlockPool
from kvdiff.trace.format import rope_pairs


def latent_qkv(attn: nn.Module, h: torch.Tensor, num_heads: int,
               interleaved: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MLA's projections of normed rows h (T, hidden) through the layer's attention module `attn`, as
    DeepseekV3Attention computes them: q (T, H, qk_nope_head_dim + qk_rope_head_dim), the RoPE key
    before RoPE (T, 1, qk_rope_head_dim) and the latent (T, kv_lora_rank). RoPE columns come in
    rotate_half order (`interleaved`: DeepSeek's pairs, de-interleaved), which RoPE then rotates with
    the bits of transformers' interleaved rotation."""
    T, nope = h.shape[0], attn.qk_nope_head_dim
    q = attn.q_proj(h) if attn.q_proj is not None else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(h)))
    q = q.view(T, num_heads, -1)
    latent, rope_key = torch.split(attn.kv_a_proj_with_mqa(h), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    q = torch.cat((q[..., :nope], rope_pairs(q[..., nope:], interleaved)), dim=-1)
    return q, rope_pairs(rope_key, interleaved).view(T, 1, -1), attn.kv_a_layernorm(latent)


def expand_latent(attn: nn.Module, latent: torch.Tensor, rope_key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every head's K (n, H, qk_nope_head_dim + qk_rope_head_dim) and V (n, H, v_head_dim) from
    cached latents (n, kv_lora_rank) and RoPE keys (n, 1, qk_rope_head_dim), through the layer's
    attention module `attn` (its kv_b_proj)."""
    n, nope = latent.shape[0], attn.qk_nope_head_dim
    kv = attn.kv_b_proj(latent).view(n, -1, nope + attn.v_head_dim)
    k_nope, v = torch.split(kv, [nope, attn.v_head_dim], dim=-1)
    return torch.cat((k_nope, rope_key.expand(-1, kv.shape[1], -1)), dim=-1), v


class LatentPool(BlockPool):
    """Per-layer pools of RoPE keys (`k`) and latents (`v`); attention reads them expanded."""

    holds_kv = False      # the paged decode kernel, which reads K and V pools directly, does not apply

    def __init__(self, attention: list[nn.Module], num_blocks: int, dtype: torch.dtype, device: torch.device,
                 block_size: int = BLOCK_SIZE, layer_devices: list[torch.device] | None = None):
        """`attention`: each layer's attention module (DeepseekV3Attention), in layer order."""
        first = attention[0]
        super().__init__(len(attention), 1, first.qk_rope_head_dim, num_blocks, dtype, device, block_size,
                         layer_devices, value_shape=(first.kv_lora_rank,))
        self.attention = attention
        self.value_dim = first.v_head_dim

    @staticmethod
    def block_bytes(attention: list[nn.Module], dtype: torch.dtype, block_size: int = BLOCK_SIZE) -> int:
        """Bytes a block of every layer takes: a latent and a RoPE key per token and layer."""
        width = sum(attn.kv_lora_rank + attn.qk_rope_head_dim for attn in attention)
        return block_size * width * torch.empty((), dtype=dtype).element_size()

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every head at `slots`, expanded from the cached latents and RoPE keys."""
        rope_key, latent = self.rows(layer, slots)
        return expand_latent(self.attention[layer], latent, rope_key)

"""Per-architecture adapters: the model's own modules, exposed for the engine to run.

The engine runs embedding, norms, projections, MLP and rotary of the transformers model
itself; only attention, positions, KV cache and scheduling are its own. An adapter knows
where each module lives and the few per-family differences (Qwen2 q/k/v bias is inside the
projections; Qwen3 normalises q and k per head before RoPE; Qwen3-MoE routes each token to
experts in place of the MLP; Gemma 3 also normalises attention's and the MLP's outputs, and its
sliding-window and global layers rotate with RoPE bases of their own; gpt-oss adds attention sinks).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from kvdiff.engine.fast_decode import fast_forwards
from kvdiff.engine.latent_cache import latent_qkv
from kvdiff.engine.numerics import patched_forwards
from kvdiff.errors import UnsupportedModelError


@dataclass
class LayerModules:
    """The modules of one decoder layer."""

    input_layernorm: nn.Module
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    post_attention_layernorm: nn.Module    # the MLP's input norm (Gemma 3: pre_feedforward_layernorm)
    mlp: nn.Module
    device: torch.device          # where the layer's weights are (layers may span GPUs)
    router: nn.Module | None = None    # a mixture-of-experts layer: h -> (router logits, top-k weights, top-k ids)
    experts: nn.Module | None = None   # (h, top-k ids, top-k weights) -> the experts' weighted sum
    attn_post_norm: nn.Module | None = None   # Gemma 3: norms of o_proj's and the MLP's outputs, before
    mlp_post_norm: nn.Module | None = None    # their residual adds
    rope_kind: str | None = None       # which of the adapter's `rope_kinds` rotates this layer
    window: int | None = None          # a sliding-window layer: a query at p sees keys p-window+1..p
    shared_experts: nn.Module | None = None   # DeepSeek: an MLP every token runs beside its experts
    latent: nn.Module | None = None    # multi-head latent attention: the layer's attention module
    sinks: torch.Tensor | None = None  # gpt-oss: per-head sink logits, one more term in softmax's denominator


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on rows x (T, heads, D) with cos/sin (T, D): the same arithmetic as transformers."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (x * cos) + (rotate_half(x) * sin)


class Adapter:
    """Llama-style decoder (Llama, Mistral, Qwen2): modules and shapes."""

    families: tuple[str, ...] = ("llama", "mistral", "qwen2")
    rope_kinds: tuple[str | None, ...] = (None,)     # one RoPE for every layer
    latent_attention = False      # MLA: the cache holds a latent and a RoPE key (latent_cache.py)
    value_point = "v"             # the probe point of what the cache holds beside k

    def __init__(self, model: nn.Module):
        self.model = model
        config = model.config
        inner = model.model
        self.config = config
        self.embed_tokens: nn.Embedding = inner.embed_tokens
        self.final_norm: nn.Module = inner.norm
        self.rotary_emb: nn.Module = inner.rotary_emb
        self.lm_head: nn.Linear = model.lm_head
        self.layers = [self._layer(layer) for layer in inner.layers[: config.num_hidden_layers]]
        attn = inner.layers[0].self_attn
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = self._head_dim(attn)
        self.scaling = float(attn.scaling)
        self.hidden_size = config.hidden_size
        self.max_positions = int(config.max_position_embeddings)
        self.windows = tuple(dict.fromkeys(layer.window for layer in self.layers))   # distinct, None: global

    @functools.cached_property
    def fast_forwards(self) -> list[tuple[nn.Module, object]]:
        """The modules fast numerics run with forwards of their own (fast_decode.fast_forwards),
        found once: fast numerics patch them every generate call."""
        return fast_forwards(self.model)

    @functools.cached_property
    def exact_forwards(self) -> list[tuple[nn.Module, object]]:
        """The modules exact numerics replace and their forwards (numerics.patched_forwards), found once."""
        return patched_forwards(self.model)

    def _head_dim(self, attn: nn.Module) -> int:
        """The width of a query head."""
        return int(attn.head_dim)

    def _layer(self, layer: nn.Module) -> LayerModules:
        attn = layer.self_attn
        return LayerModules(
            input_layernorm=layer.input_layernorm,
            q_proj=attn.q_proj, k_proj=attn.k_proj, v_proj=attn.v_proj, o_proj=attn.o_proj,
            q_norm=getattr(attn, "q_norm", None), k_norm=getattr(attn, "k_norm", None),
            post_attention_layernorm=layer.post_attention_layernorm,
            mlp=layer.mlp,
            device=layer.input_layernorm.weight.device,
            window=self._window(attn),
        )

    def _window(self, attn: nn.Module) -> int | None:
        """The layer's sliding window (its own attribute where the family has one, else the config's;
        None for a global layer or a window no shorter than the context)."""
        window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(self.config, "sliding_window", None)
        return int(window) if window is not None and window < self.config.max_position_embeddings else None

    def qkv(self, layer: LayerModules, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (T, H, D), k before RoPE (T, KVH, D), v (T, KVH, D) from normed rows h (T, hidden)."""
        T = h.shape[0]
        q = layer.q_proj(h).view(T, self.num_heads, self.head_dim)
        k = layer.k_proj(h).view(T, self.num_kv_heads, self.head_dim)
        v = layer.v_proj(h).view(T, self.num_kv_heads, self.head_dim)
        return q, k, v

    def rotate_q(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q after RoPE."""
        return apply_rope(q, cos, sin)

    def rope(self, like: torch.Tensor, positions: torch.Tensor,
             kind: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (T, D) at `positions` (T,), from the model's own rotary embedding (of the
        layers of `kind`, one of `rope_kinds`)."""
        cos, sin = self.rotary_emb(like, positions.unsqueeze(0)) if kind is None else \
            self.rotary_emb(like, positions.unsqueeze(0), kind)
        return cos[0], sin[0]


class Qwen3Adapter(Adapter):
    """Qwen3: q and k are RMS-normalised per head (q_norm, k_norm) before RoPE."""

    families = ("qwen3",)

    def qkv(self, layer, h):
        q, k, v = super().qkv(layer, h)
        return layer.q_norm(q), layer.k_norm(k), v


class Qwen3MoeAdapter(Qwen3Adapter):
    """Qwen3-MoE: Qwen3 attention; a sparse layer's MLP is a router and experts (the model's
    Qwen3MoeTopKRouter and Qwen3MoeExperts), a dense one (`mlp_only_layers`) a plain MLP."""

    families = ("qwen3_moe",)

    def _layer(self, layer: nn.Module) -> LayerModules:
        modules = super()._layer(layer)
        if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts"):
            modules.router, modules.experts = layer.mlp.gate, layer.mlp.experts
        return modules


class Gemma3Adapter(Qwen3Adapter):
    """Gemma 3 (text): Qwen3's q/k norms, four norms a layer (input, after attention, before and
    after the MLP; each scales by 1 + weight, inside the module), the embedding scaled by
    sqrt(hidden) (inside the module), and layers of two kinds, sliding-window and global, each with
    its RoPE base. Logit soft-capping (Gemma 2's) is refused."""

    families = ("gemma3_text",)

    def __init__(self, model: nn.Module):
        config = model.config
        capped = [name for name in ("attn_logit_softcapping", "final_logit_softcapping") if getattr(config, name, None)]
        if capped:
            raise UnsupportedModelError(f"{' and '.join(capped)} set: kvdiff's engine has no soft-capped attention "
                                        "or logits; use a model without soft-capping")
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedModelError("use_bidirectional_attention set: kvdiff's engine generates causally; "
                                        "use a causal (generative) Gemma 3")
        self.rope_kinds = tuple(sorted(set(config.layer_types)))
        super().__init__(model)

    def _layer(self, layer: nn.Module) -> LayerModules:
        modules = super()._layer(layer)
        modules.post_attention_layernorm = layer.pre_feedforward_layernorm
        modules.attn_post_norm, modules.mlp_post_norm = layer.post_attention_layernorm, layer.post_feedforward_layernorm
        modules.rope_kind = layer.self_attn.layer_type
        return modules


class GptOssAdapter(Adapter):
    """gpt-oss: biased q/k/v/o projections (inside the modules), sliding-window and global layers in
    turn, per-head attention sinks (a learned logit in each head's softmax denominator), a router
    (GptOssTopKRouter: top-k of the logits, softmax over those k) and experts in place of the MLP,
    and RoPE (YaRN) rotating the two halves of a head with cos/sin of half its width."""

    families = ("gpt_oss",)

    def _layer(self, layer: nn.Module) -> LayerModules:
        modules = super()._layer(layer)
        modules.router, modules.experts = layer.mlp.router, layer.mlp.experts
        modules.sinks = layer.self_attn.sinks
        return modules

    def rope(self, like, positions, kind=None):
        """cos, sin (T, D): the model's (T, D/2), repeated for both halves (its first half rotates
        as x1 cos - x2 sin, rotate_half's x1 cos + (-x2) sin, bit for bit)."""
        cos, sin = super().rope(like, positions, kind)
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


class DeepseekV3Adapter(Adapter):
    """DeepSeek-V3: multi-head latent attention (latent_cache.py: per token the cache holds a latent and
    one RoPE key all heads share; only the last qk_rope_head_dim columns of each query head are
    rotated) and, after `first_k_dense_replace` dense layers, routed experts beside a shared one."""

    families = ("deepseek_v3",)
    latent_attention = True
    value_point = "kv_latent"

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.num_kv_heads = 1
        self.rope_dim = int(self.config.qk_rope_head_dim)

    def _head_dim(self, attn: nn.Module) -> int:
        return int(attn.qk_head_dim)

    def _layer(self, layer: nn.Module) -> LayerModules:
        attn, mlp = layer.self_attn, layer.mlp
        moe = hasattr(mlp, "gate")
        return LayerModules(
            input_layernorm=layer.input_layernorm, q_proj=None, k_proj=None, v_proj=None, o_proj=attn.o_proj,
            q_norm=None, k_norm=None, post_attention_layernorm=layer.post_attention_layernorm, mlp=mlp,
            device=layer.input_layernorm.weight.device, router=mlp.gate if moe else None,
            experts=mlp.experts if moe else None, shared_experts=mlp.shared_experts if moe else None, latent=attn)

    def qkv(self, layer, h):
        """q (T, H, nope + rope), the RoPE key before RoPE (T, 1, rope) and the latent (T, kv_lora_rank)."""
        return latent_qkv(layer.latent, h, self.num_heads, bool(self.config.rope_interleave))

    def rotate_q(self, q, cos, sin):
        nope = q.shape[-1] - self.rope_dim
        return torch.cat((q[..., :nope], apply_rope(q[..., nope:], cos, sin)), dim=-1)


ADAPTERS: dict[str, type[Adapter]] = {family: cls for cls in (Adapter, Qwen3Adapter, Qwen3MoeAdapter, Gemma3Adapter,
                                                              GptOssAdapter, DeepseekV3Adapter)
                                      for family in cls.families}


def get_adapter(model: nn.Module) -> Adapter:
    """The adapter of `model`'s architecture; UnsupportedModelError names the supported ones."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    cls = ADAPTERS.get(model_type)
    if cls is None:
        raise UnsupportedModelError(
            f"architecture {model_type!r} has no engine adapter: supported are {', '.join(sorted(ADAPTERS))}")
    return cls(model)

"""Probe point names: the same on every path (reference, engine, a user's model).

Named after what they hold, in dataflow order within a decoder layer, as TransformerLens does.
Row layout of every capture is (tokens, ...) indexed by 0-based global position.
"""

from __future__ import annotations

from typing import Iterable

from kvdiff.errors import InputError

# Per decoder layer, in dataflow order.
LAYER_POINTS: tuple[str, ...] = (
    "resid_pre",   # (T, hidden)   input of the decoder layer
    "attn_norm",   # (T, hidden)   input_layernorm output
    "q",           # (T, n_heads, head_dim)     query after q-norm (if any) and RoPE, as attention reads it
    "k_pre_rope",  # (T, n_kv_heads, head_dim)  key after k-norm (if any), before RoPE
    "k",           # (T, n_kv_heads, head_dim)  key after RoPE, as stored in the cache / read by attention
    "v",           # (T, n_kv_heads, head_dim)
    "z",           # (T, n_heads, head_dim)     attention's output, softmax(q k^T) v per head: o_proj's input
    "attn_out",    # (T, hidden)   o_proj output
    "resid_mid",   # (T, hidden)   resid_pre + attn_out
    "mlp_norm",    # (T, hidden)   post_attention_layernorm output
    "mlp_out",     # (T, hidden)   MLP output
    "resid_post",  # (T, hidden)   output of the decoder layer
)

# Per mixture-of-experts layer, between mlp_norm and mlp_out: only models with a router have them.
MOE_POINTS: tuple[str, ...] = (
    "router_logits",  # (T, n_experts)  the router's logits (before softmax and top-k)
    "experts",        # (T, top_k)      the chosen expert ids, best first (ids stored as float32: exact)
)

# Norms after attention and after the MLP, before each residual add (Gemma 3's "sandwich"): only
# models with them have these points; resid_mid and resid_post then add these instead.
POST_NORM_POINTS: tuple[str, ...] = (
    "attn_post_norm",  # (T, hidden)  post_attention_layernorm of attn_out
    "mlp_post_norm",   # (T, hidden)  post_feedforward_layernorm of mlp_out
)

# Multi-head latent attention (DeepSeek-V3) caches no V: a compressed latent per token, expanded
# into every head's K and V where attention reads it. Its models have this point instead of v (and
# no z: their heads' values are another width than head_dim, which the trace does not declare); their
# k_pre_rope and k are the RoPE key all heads share (T, 1, qk_rope_head_dim), before and after RoPE,
# in rotate_half order (DeepSeek's interleaved pairs (0, 1), (2, 3), ... de-interleaved).
MLA_POINTS: tuple[str, ...] = (
    "kv_latent",   # (T, kv_lora_rank)  kv_a_layernorm output: what the cache holds beside k
)

# Attention sinks (gpt-oss): each head's learned sink logit, one more term in its softmax's
# denominator; recorded per token as attention applied it, so a sink the engine misses or misreads
# is where the traces first part.
SINK_POINTS: tuple[str, ...] = (
    "attn_sinks",  # (T, n_heads)  the sink logit of each head
)

# Every layer point a model may have, in dataflow order.
KNOWN_LAYER_POINTS: tuple[str, ...] = (
    "resid_pre", "attn_norm", "q", "k_pre_rope", "k", "kv_latent", "v", "attn_sinks", "z", "attn_out", "attn_post_norm", "resid_mid", "mlp_norm",
    "router_logits", "experts", "mlp_out", "mlp_post_norm", "resid_post",
)

# After the last layer.
FINAL_POINTS: tuple[str, ...] = ("final_norm", "logits")

# The points every model has (a dense model's), and every point a model may have.
ALL_POINTS: tuple[str, ...] = LAYER_POINTS + FINAL_POINTS
KNOWN_POINTS: tuple[str, ...] = KNOWN_LAYER_POINTS + FINAL_POINTS

# What a reads-only bracket records: the cache rows attention reads, computed elsewhere.
READ_POINTS: tuple[str, ...] = ("k", "v", "kv_latent")

# Norm modules whose per-token statistics are recorded: per layer, and once after the last layer.
LAYER_NORMS: tuple[str, ...] = ("attn_norm", "mlp_norm") + POST_NORM_POINTS
FINAL_NORMS: tuple[str, ...] = ("final_norm",)

# Per-token norm statistics, computed in float64.
NORM_STATS: tuple[str, ...] = ("input_rms", "mean", "variance", "max_abs", "output_rms")

# Dataflow rank of a point inside a layer; final points come after every layer point.
POINT_ORDER: dict[str, int] = {name: i for i, name in enumerate(KNOWN_POINTS)}


def parse_points(capture: str | Iterable[str]) -> tuple[str, ...]:
    """'q, k' (or ['q', 'k']) -> ('q', 'k') in dataflow order; unknown names are an InputError."""
    names = [p.strip() for p in capture.split(",")] if isinstance(capture, str) else list(capture)
    unknown = [p for p in names if p not in POINT_ORDER]
    if unknown or not names:
        raise InputError(f"unknown probe point(s) {', '.join(unknown) or '(none)'}: "
                         f"choose from {', '.join(KNOWN_POINTS)}")
    return tuple(sorted(set(names), key=POINT_ORDER.__getitem__))

"""Each head's keys and values as attention read them, for the attention recomputations
(diagnose_context, diagnose_cached_context), on every family.

A K/V trace records them (`k`, `v`). A multi-head latent attention trace (`latent_dim` > 0,
DeepSeek-V3) records per token what its cache holds, the latent (`kv_latent`) and the RoPE key all
heads share (`k`, after RoPE), and per layer kv_b_proj's weight per head (`/weights/<i>/kv_b_proj`,
(heads, qk_nope_head_dim + v_head_dim, latent_dim)). They are expanded as the model expands them
(transformers' DeepseekV3Attention.expand_kv, the engine's latent_cache.expand_latent): a head's key
is its first qk_nope_head_dim weight rows times the latent followed by the shared RoPE key, its value
the other rows times the latent. `q` holds each head's qk_nope_head_dim columns, then its RoPE
columns, rotated, in the key's order: q against these keys is the model's attention scores.
"""

from __future__ import annotations

import numpy as np

from kvdiff.analysis.diagnosis import DiagnosisInputs
from kvdiff.trace.format import ModelDims

QKV = tuple[np.ndarray, np.ndarray, np.ndarray]


def value_point(dims: ModelDims) -> str:
    """The probe point of what the cache holds beside k: kv_latent with latent attention, else v."""
    return "kv_latent" if dims.latent_dim else "v"


def attention_points(dims: ModelDims) -> set[str]:
    """The points the attention recomputation reads."""
    return {"q", "k", value_point(dims)}


def rope_columns(dims: ModelDims) -> slice:
    """The columns of a query head RoPE rotates: the last rope_dim with latent attention, else all."""
    return slice(dims.head_dim - dims.rope_dim, None) if dims.latent_dim else slice(None)


def expand(latent: np.ndarray, rope_key: np.ndarray, weight: np.ndarray, nope: int) -> tuple[np.ndarray, np.ndarray]:
    """Every head's K (n, heads, nope + rope) and V (n, heads, v_head_dim), float32, from latents
    (n, latent_dim), shared RoPE keys (n, 1, rope) and kv_b_proj per head (heads, nope + v_head_dim,
    latent_dim), whose first `nope` rows make a head's key without RoPE. Products in float64."""
    kv = np.einsum("nl,hdl->nhd", latent.astype(np.float64), weight.astype(np.float64)).astype(np.float32)
    shared = np.broadcast_to(rope_key, (rope_key.shape[0], weight.shape[0], rope_key.shape[2]))
    return np.concatenate((kv[..., :nope], shared), axis=-1), np.ascontiguousarray(kv[..., nope:])


def attention_rows(inputs: DiagnosisInputs, layer: int) -> tuple[QKV, QKV] | None:
    """(reference's, candidate's) q, k and v of `layer` at the aligned positions, every head's as its
    attention read them; None where a latent attention trace holds no kv_b_proj weight of the layer
    (or the two traces' differ in shape)."""
    dims = inputs.reference.meta.dims
    if not dims.latent_dim:
        rows = [inputs.rows(layer, point) for point in ("q", "k", "v")]
        return tuple((rows[0][i], rows[1][i], rows[2][i]) for i in (0, 1))
    weights = [trace.latent_weight(layer) for trace in (inputs.reference, inputs.candidate)]
    if weights[0] is None or weights[1] is None or weights[0].shape != weights[1].shape:
        return None
    q, k, latent = (inputs.rows(layer, point) for point in ("q", "k", "kv_latent"))
    nope = dims.head_dim - dims.rope_dim
    return tuple((q[i], *expand(latent[i], k[i], weights[i], nope)) for i in (0, 1))

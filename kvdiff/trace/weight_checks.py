"""A trace's model weights, checked for place, dtype and shape before any is read (the analysis
sizes its arrays by them): /norms, each norm's weight and epsilon, and, for multi-head latent
attention, /weights, each layer's kv_b_proj per head (what expands a latent into every head's K
and V), and, for DeepSeek's routing, each layer's router bias."""

from __future__ import annotations

from pathlib import Path

import h5py

from kvdiff.trace.checks import MAX_DIMS, _dataset, _member, as_float, malformed, read_attr
from kvdiff.trace.format import LATENT_WEIGHT, ROUTER_BIAS, WEIGHTS_GROUP, ModelDims

MAX_WEIGHT_VALUES = 1 << 28            # one kv_b_proj (DeepSeek-V3's: 128 heads x 256 x 512 = 16.8M values)


def _check_norm_weights(path: Path, f: h5py.File, dims: ModelDims) -> None:
    """norms/<i>/<norm>: 1-D float weights of the norm's width with a finite eps."""
    norms = _member(path, f, "norms", h5py.Group, required=False)
    for layer in norms or ():
        group = _member(path, norms, layer, h5py.Group)
        for name in group:
            ds = _dataset(path, group, name)
            width = dims.head_dim if name in ("q_norm", "k_norm") else dims.hidden_size
            if ds.dtype.kind != "f" or ds.shape != (width,):
                raise malformed(path, f"{ds.name} must be a float dataset of shape ({width},)")
            as_float(path, f"eps of {ds.name}", read_attr(path, ds, "eps"))


def _check_layer_weights(path: Path, f: h5py.File, dims: ModelDims) -> None:
    """weights/<i>/: `i` a layer of the model, holding kv_b_proj (latent attention only: float
    (num_heads, qk_nope_head_dim + v_head_dim, latent_dim), qk_nope_head_dim = head_dim - rope_dim,
    v_head_dim at least 1, one shape for every layer) and router_bias (DeepSeek's routing only: float
    (num_experts,))."""
    weights = _member(path, f, WEIGHTS_GROUP, h5py.Group, required=False)
    allowed = {LATENT_WEIGHT} if dims.latent_dim else set()
    allowed |= {ROUTER_BIAS} if dims.expert_groups else set()
    nope = dims.head_dim - dims.rope_dim
    if dims.latent_dim and nope < 0:
        raise malformed(path, f"rope_dim {dims.rope_dim} exceeds head_dim {dims.head_dim}")
    shapes = set()
    for name in weights or ():
        if not name.isdecimal() or int(name) >= dims.num_layers:
            raise malformed(path, f"/{WEIGHTS_GROUP}/{name!r} is not one of the model's {dims.num_layers} layers")
        group = _member(path, weights, name, h5py.Group)
        extra = sorted(set(group) - allowed)
        if extra:
            raise malformed(path, f"{group.name} holds {extra}: a layer's weights of this model are "
                                  f"{sorted(allowed) or 'none'} (kv_b_proj with latent_dim, router_bias with expert_groups)")
        if ROUTER_BIAS in group:
            ds = _dataset(path, group, ROUTER_BIAS)
            if ds.dtype.kind != "f" or ds.shape != (dims.num_experts,):
                raise malformed(path, f"{ds.name} must be a float dataset of shape ({dims.num_experts},)")
        if LATENT_WEIGHT not in group:
            continue
        ds = _dataset(path, group, LATENT_WEIGHT)
        v_dim = ds.shape[1] - nope if ds.ndim == 3 else 0
        if ds.dtype.kind != "f" or ds.ndim != 3 or (ds.shape[0], ds.shape[2]) != (dims.num_heads, dims.latent_dim) \
                or not 0 < v_dim <= MAX_DIMS["head_dim"] or ds.size > MAX_WEIGHT_VALUES:
            raise malformed(path, f"{ds.name} must be a float dataset of shape ({dims.num_heads}, {nope} + v_head_dim, "
                                  f"{dims.latent_dim}) of at most {MAX_WEIGHT_VALUES} values, not {ds.shape} {ds.dtype}")
        shapes.add(ds.shape)
    if len(shapes) > 1:
        raise malformed(path, f"the layers' {LATENT_WEIGHT} weights differ in shape ({sorted(shapes)}): every "
                              "layer's heads expand the latent alike")


def check_weights(path: Path, f: h5py.File, dims: ModelDims) -> None:
    """The norm weights, latent attention's kv_b_proj and DeepSeek's router biases a trace holds (all optional)."""
    _check_norm_weights(path, f, dims)
    _check_layer_weights(path, f, dims)

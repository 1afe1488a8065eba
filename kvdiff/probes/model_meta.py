"""What a trace records about a transformers model: dimensions, norm modules and versions."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from kvdiff.probes.selection import Selection
from kvdiff.probes.spec import ProbeSpec, compile_pattern, layer_of
from kvdiff.trace.fingerprint import model_fingerprint, tokenizer_fingerprint
from kvdiff.trace.format import ModelDims, TraceMeta, dtype_name
from kvdiff.version import __version__


def model_dims(model: torch.nn.Module) -> ModelDims:
    """The row shapes of a transformers model's probe points, read from its config and modules."""
    c = model.config
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    latent = dict(latent_dim=int(c.kv_lora_rank), rope_dim=int(c.qk_rope_head_dim)) if _latent(model) else {}
    if latent:      # the query's heads are qk_nope_head_dim + qk_rope_head_dim wide; one RoPE key for all
        head_dim, kv_heads = int(c.qk_nope_head_dim) + latent["rope_dim"], 1
    attention, router, grouped = _found_modules(model)
    scale = None if attention is None else float(attention.scaling)
    experts = (int(router.num_experts), int(router.top_k)) if router is not None else (0, 0)
    groups = {} if grouped is None else dict(expert_groups=int(grouped.num_group),
                                             groups_chosen=int(grouped.topk_group))
    return ModelDims(c.num_hidden_layers, heads, kv_heads, head_dim,
                     c.hidden_size, c.vocab_size, head_dim ** -0.5 if scale is None else scale,
                     *experts, post_norms=int(_post_norms(model)), sinks=int(_sinks(model)), **latent, **groups,
                     layer_windows=_windows(model))


_found_memo: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[list, tuple]]" = weakref.WeakKeyDictionary()


def _module_tree(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every module of `model` once, in `model.modules()`' order: a walk of `_modules` alone, a
    tenth of the cost of `modules()` with `_found_modules`' checks."""
    out, seen, stack = [], set(), [model]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        out.append(m)
        stack.extend(reversed([c for c in m._modules.values() if c is not None]))
    return out


def _same_tree(refs: list[weakref.ref], tree: list[torch.nn.Module]) -> bool:
    """Whether `tree` is the modules `refs` were taken of, each the same object (weak references:
    the memo keeps no module alive, and a module's id may be reused after it is gone)."""
    return len(refs) == len(tree) and all(ref() is m for ref, m in zip(refs, tree))


def _found_modules(model: torch.nn.Module) -> tuple:
    """(the first attention module with `scaling` and `layer_idx`, the first router, the first
    module of DeepSeek's grouped routing), each None where the model has none.

    Found by a walk checking every module (~2.5 ms for a 30-layer model on the VM, which every
    trace's set-up paid) once per model object, and remembered with its module tree: found again
    when a module was added, removed or replaced. The caller reads their attributes each time."""
    tree = _module_tree(model)
    known = _found_memo.get(model)
    if known is not None and _same_tree(known[0], tree):
        return tuple(None if i is None else tree[i] for i in known[1])
    attention = router = grouped = None
    for i, m in enumerate(tree):       # one walk for the three
        if attention is None and _has(m, "scaling") and _has(m, "layer_idx"):
            attention = i
        if router is None and _is_router(m):
            router = i
        if grouped is None and _groups_experts(m):
            grouped = i
    found = (attention, router, grouped)
    _found_memo[model] = ([weakref.ref(m) for m in tree], found)
    return tuple(None if i is None else tree[i] for i in found)


def _latent(model: torch.nn.Module) -> bool:
    """Whether the model's attention is multi-head latent attention (DeepSeek-V2/V3's kv_lora_rank)."""
    return getattr(model.config, "kv_lora_rank", None) is not None


def _sinks(model: torch.nn.Module) -> bool:
    """Whether every decoder layer's attention has per-head sink logits (gpt-oss)."""
    layers = getattr(getattr(model, "model", None), "layers", ())
    return bool(layers) and all(isinstance(getattr(layer.self_attn, "sinks", None), torch.Tensor) for layer in layers)


def _windows(model: torch.nn.Module) -> tuple[int, ...]:
    """Each decoder layer's sliding window (0: global), from its attention's own `sliding_window`
    where the family sets one per layer (Gemma 3, gpt-oss, Qwen2), else the config's; () where no
    layer has a window shorter than the context."""
    c = model.config
    context = getattr(c, "max_position_embeddings", None) or 1 << 62
    layers = getattr(getattr(model, "model", None), "layers", ())
    windows = []
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(c, "sliding_window", None)
        windows.append(int(window) if isinstance(window, int) and 0 < window < context else 0)
    return tuple(windows) if any(windows) and len(windows) == c.num_hidden_layers else ()


def _post_norms(model: torch.nn.Module) -> bool:
    """Whether every decoder layer normalises attention's and the MLP's outputs too (Gemma 3)."""
    layers = getattr(getattr(model, "model", None), "layers", ())
    return bool(layers) and all(hasattr(layer, "post_feedforward_layernorm") for layer in layers)


def experts_shape(model: torch.nn.Module) -> tuple[int, int]:
    """(experts per layer, experts chosen per token) of a model with routers; (0, 0) for a dense
    model. In a model mixing dense layers in, those hold the fixed rows of `dense_router_rows`.
    Routers are the modules with `num_experts`, `top_k` and a weight."""
    router = next((m for m in model.modules() if _is_router(m)), None)
    return (0, 0) if router is None else (int(router.num_experts), int(router.top_k))


_MISSING = object()


def _attribute(m: torch.nn.Module, name: str, default=None):
    """`m.name`, or `default` where it has none. Looked up where nn.Module keeps attributes: a
    missing one through getattr raises (and formats) an AttributeError, ~1 us a module and
    name, and a trace's set-up asks a few names of every module."""
    for held in (m.__dict__, m._parameters, m._buffers, m._modules):
        if name in held:
            return held[name]
    return getattr(m, name, default) if hasattr(type(m), name) else default


def _has(m: torch.nn.Module, name: str) -> bool:
    return _attribute(m, name, _MISSING) is not _MISSING


def _is_router(m: torch.nn.Module) -> bool:
    return _has(m, "num_experts") and _has(m, "top_k") and isinstance(_attribute(m, "weight"), torch.Tensor)


def _groups_experts(m: torch.nn.Module) -> bool:
    """DeepSeek's routing: routers with `num_group`, `topk_group` and `e_score_correction_bias`."""
    return isinstance(_attribute(m, "e_score_correction_bias"), torch.Tensor)


# RMSNorms that scale by (1 + weight), computed in float32 (Gemma's): traces store the scale itself.
OFFSET_NORMS = ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")


@dataclass(frozen=True)
class NormScale:
    """The scale and epsilon a norm applies, where its module stores the scale as an offset from 1."""

    weight: torch.Tensor
    eps: float


def norm_modules(model: torch.nn.Module, spec: ProbeSpec) -> dict[tuple[int | None, str], torch.nn.Module | NormScale]:
    """(layer, norm name) -> norm module (a NormScale for an offset norm: its weight is the scale
    `w * x / rms(x)` applies), for the spec's norm rules and its weight-only norms."""
    patterns = [(norm, compile_pattern(pattern)) for norm, pattern in
                [(r.point, r.pattern) for r in spec.rules if r.kind == "norm"] + list(spec.weight_norms.items())]
    found: dict[tuple[int | None, str], torch.nn.Module | NormScale] = {}
    for name, module in model.named_modules():        # one walk for every pattern
        for norm, regex in patterns:
            if regex.match(name):
                found[(layer_of(name), norm)] = module
    rank = {norm: i for i, (norm, _) in reversed(list(enumerate(patterns)))}       # a norm's first pattern
    return {key: NormScale(1.0 + m.weight.detach().float(), norm_eps(m)) if type(m).__name__ in OFFSET_NORMS else m
            for key, m in sorted(found.items(), key=lambda item: rank[item[0][1]])}


def router_biases(model: torch.nn.Module, layers: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """DeepSeek's routing: each of `layers`' e_score_correction_bias (a routed layer's; a dense layer
    has none), which is added to the sigmoid scores to choose the experts."""
    out = {}
    for layer in layers:
        bias = getattr(getattr(model.model.layers[layer].mlp, "gate", None), "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            out[layer] = bias
    return out


def latent_weights(model: torch.nn.Module, layers: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """Multi-head latent attention: each of `layers`' kv_b_proj weight viewed per head, (heads,
    qk_nope_head_dim + v_head_dim, kv_lora_rank); {} for a model without latent attention."""
    if not _latent(model):
        return {}
    heads = model.config.num_attention_heads
    return {layer: model.model.layers[layer].self_attn.kv_b_proj.weight.view(heads, -1, model.config.kv_lora_rank)
            for layer in layers}


def norm_eps(module: torch.nn.Module) -> float:
    for attr in ("variance_epsilon", "eps", "epsilon"):
        if hasattr(module, attr):
            return float(getattr(module, attr))
    raise ValueError(f"norm module {type(module).__name__} has no epsilon attribute")


def build_meta(model, tokenizer, messages: list[dict], input_ids, selection: Selection, dims: ModelDims,
               strategy: str, numerics: str, fingerprint: str | None = None) -> TraceMeta:
    """The metadata known before generation starts (generated ids, text and chunks come at finish).
    `dims`: the model's `model_dims`. `fingerprint`: the model's `model_fingerprint`, when the caller
    has it already (hashing every weight takes about half a second for the default model on a CPU)."""
    import transformers

    param = next(model.parameters())
    return TraceMeta(
        kvdiff_version=__version__,
        model_name=str(getattr(model, "kvdiff_source", None) or getattr(model, "name_or_path", "") or
                       type(model).__name__),
        model_fingerprint=fingerprint or model_fingerprint(model),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        dtype=dtype_name(param.dtype), device=str(param.device),
        torch_version=str(torch.__version__), transformers_version=transformers.__version__,
        strategy=strategy, numerics=numerics, messages=[dict(m) for m in messages],
        input_ids=np.asarray(input_ids, dtype=np.int64),
        dims=dims, points=selection.points, layers=selection.layers,
    )

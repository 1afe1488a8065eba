"""Probe specs: which module of a model holds which probe point, by module-name pattern.

Patterns are dotted module names where `*` matches one name part and `**` any number of them.
The layer of a match is the number after `layers.` in its name (None for final points).
A custom model or engine passes its own ProbeSpec to record the same trace format.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterator, Literal

import torch

from kvdiff.errors import UnsupportedModelError
from kvdiff.trace.format import rope_pairs
from kvdiff.trace.points import FINAL_POINTS, KNOWN_POINTS

Kind = Literal["output", "input", "norm"]
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class ProbeRule:
    """Module(s) matching `pattern` give probe `point`.

    kind: "output" captures the module's output, "input" its first input (a pre-hook), "norm"
    its output as the point plus input and output for the norm statistics. `index`: which element
    of a tuple output; `flat`: the module sees the tokens as rows (T, ...) with no batch dimension
    (a router); `heads_first`: its output is (batch, heads, T, head_dim) (Gemma's k_norm runs after
    the transpose). `rope_key`: the output ends with MLA's RoPE key (kv_a_proj_with_mqa): its last
    qk_rope_head_dim columns are taken, as one head, in rotate_half order. Integer outputs (expert
    ids) are captured as float32.
    """

    pattern: str
    point: str
    kind: Kind = "output"
    index: int = 0
    flat: bool = False
    heads_first: bool = False
    rope_key: bool = False

    def __post_init__(self) -> None:
        if self.point not in KNOWN_POINTS:
            raise ValueError(f"probe rule {self.pattern!r}: unknown point {self.point!r}")

    def regex(self) -> re.Pattern:
        return compile_pattern(self.pattern)

    def rows(self, output, config) -> torch.Tensor:
        """The point's rows (batch, T, ...) from a matching module's `output` (the model's `config`
        gives MLA's RoPE width)."""
        out = output[self.index] if isinstance(output, tuple) else output
        if self.flat:        # (T, ...) rows of the forward's one sequence
            out = out.unsqueeze(0)
        if self.heads_first:     # (1, heads, T, head_dim) -> (1, T, heads, head_dim)
            out = out.transpose(1, 2)
        if self.rope_key:        # MLA's (1, T, latent + rope) -> the RoPE key (1, T, 1, rope), rotate_half order
            out = rope_pairs(out[..., -config.qk_rope_head_dim:], config.rope_interleave).unsqueeze(2)
        return out if out.is_floating_point() else out.float()


def compile_pattern(pattern: str) -> re.Pattern:
    """A module-name pattern as a regex: `*` one name part, `**` any number of them."""
    parts = (re.escape(p).replace(r"\*\*", ".+").replace(r"\*", r"[^.]+") for p in pattern.split("."))
    return re.compile(r"\.".join(parts) + "$")


def layer_of(module_name: str) -> int | None:
    """The decoder layer a module belongs to (the number after `layers.`), None outside layers."""
    found = _LAYER.search(module_name)
    return int(found.group(1)) if found else None


@dataclass(frozen=True)
class ProbeSpec:
    """Module rules, plus whether q and k come from the attention-function wrapper."""

    rules: tuple[ProbeRule, ...]
    attention_points: tuple[str, ...] = ("q", "k")      # captured inside the attention function
    weight_norms: dict[str, str] = field(default_factory=dict)  # extra norms whose weights are kept
    latent_attention: bool = False    # MLA: k is the attention key's shared RoPE part (last columns, one head)

    def matches(self, model: torch.nn.Module) -> Iterator[tuple[ProbeRule, str, torch.nn.Module, int | None]]:
        """(rule, module name, module, layer) for every module a rule matches."""
        compiled = [(rule, rule.regex()) for rule in self.rules]
        for name, module in model.named_modules():
            for rule, regex in compiled:
                if regex.match(name):
                    layer = layer_of(name)
                    if (layer is None) != (rule.point in FINAL_POINTS):
                        raise ValueError(f"probe rule {rule.pattern!r} matched {name!r}: "
                                         f"point {rule.point!r} {'needs' if layer is None else 'takes no'} a layer")
                    yield rule, name, module, layer


def _decoder_rules(k_pre_rope: str) -> tuple[ProbeRule, ...]:
    return (
        ProbeRule("model.layers.*", "resid_pre", "input"),
        ProbeRule("model.layers.*.input_layernorm", "attn_norm", "norm"),
        ProbeRule(k_pre_rope, "k_pre_rope"),
        ProbeRule("model.layers.*.self_attn.v_proj", "v"),
        ProbeRule("model.layers.*.self_attn.o_proj", "z", "input"),
        ProbeRule("model.layers.*.self_attn.o_proj", "attn_out"),
        ProbeRule("model.layers.*.post_attention_layernorm", "resid_mid", "input"),
        ProbeRule("model.layers.*.post_attention_layernorm", "mlp_norm", "norm"),
        ProbeRule("model.layers.*.mlp", "mlp_out"),
        ProbeRule("model.layers.*", "resid_post"),
        ProbeRule("model.norm", "final_norm", "norm"),
        ProbeRule("lm_head", "logits"),
    )


LLAMA_SPEC = ProbeSpec(_decoder_rules("model.layers.*.self_attn.k_proj"))
QWEN3_SPEC = ProbeSpec(
    _decoder_rules("model.layers.*.self_attn.k_norm"),
    weight_norms={"q_norm": "model.layers.*.self_attn.q_norm", "k_norm": "model.layers.*.self_attn.k_norm"},
)
# Gemma 3: q/k norms, and norms after attention and after the MLP too (the MLP's input norm is
# pre_feedforward_layernorm; post_attention_layernorm normalises attention's output).
GEMMA3_SPEC = ProbeSpec(
    (
        ProbeRule("model.layers.*", "resid_pre", "input"),
        ProbeRule("model.layers.*.input_layernorm", "attn_norm", "norm"),
        ProbeRule("model.layers.*.self_attn.k_norm", "k_pre_rope", heads_first=True),
        ProbeRule("model.layers.*.self_attn.v_proj", "v"),
        ProbeRule("model.layers.*.self_attn.o_proj", "z", "input"),
        ProbeRule("model.layers.*.self_attn.o_proj", "attn_out"),
        ProbeRule("model.layers.*.post_attention_layernorm", "attn_post_norm", "norm"),
        ProbeRule("model.layers.*.pre_feedforward_layernorm", "resid_mid", "input"),
        ProbeRule("model.layers.*.pre_feedforward_layernorm", "mlp_norm", "norm"),
        ProbeRule("model.layers.*.mlp", "mlp_out"),
        ProbeRule("model.layers.*.post_feedforward_layernorm", "mlp_post_norm", "norm"),
        ProbeRule("model.layers.*", "resid_post"),
        ProbeRule("model.norm", "final_norm", "norm"),
        ProbeRule("lm_head", "logits"),
    ),
    weight_norms=QWEN3_SPEC.weight_norms,
)
# The router (Qwen3MoeTopKRouter) returns (logits, top-k weights, top-k ids) over flattened tokens.
QWEN3_MOE_SPEC = ProbeSpec(
    QWEN3_SPEC.rules + (ProbeRule("model.layers.*.mlp.gate", "router_logits", flat=True),
                        ProbeRule("model.layers.*.mlp.gate", "experts", index=2, flat=True)),
    weight_norms=QWEN3_SPEC.weight_norms,
)
# DeepSeek-V3 (multi-head latent attention): the RoPE key before RoPE is the end of kv_a_proj_with_mqa's
# output, the latent kv_a_layernorm's; its router (DeepseekV3TopkRouter) returns what Qwen3-MoE's does.
DEEPSEEK_V3_SPEC = ProbeSpec(
    tuple(r for r in LLAMA_SPEC.rules if r.point not in ("k_pre_rope", "v", "z"))
    + (ProbeRule("model.layers.*.self_attn.kv_a_proj_with_mqa", "k_pre_rope", rope_key=True),
       ProbeRule("model.layers.*.self_attn.kv_a_layernorm", "kv_latent")) + QWEN3_MOE_SPEC.rules[-2:],
    latent_attention=True,
)
# gpt-oss: Llama's modules (k_proj's output, its bias added, is k before RoPE), its sinks from the
# attention function's arguments; the router
# (GptOssTopKRouter) returns (logits, top-k weights, top-k ids) as Qwen3-MoE's does; the MLP returns
# (output, router scores).
GPT_OSS_SPEC = ProbeSpec(
    LLAMA_SPEC.rules + (ProbeRule("model.layers.*.mlp.router", "router_logits", flat=True),
                        ProbeRule("model.layers.*.mlp.router", "experts", index=2, flat=True)),
    attention_points=("q", "k", "attn_sinks"),
)
DEFAULT_SPECS: dict[str, ProbeSpec] = {
    "llama": LLAMA_SPEC, "mistral": LLAMA_SPEC, "qwen2": LLAMA_SPEC, "qwen3": QWEN3_SPEC, "qwen3_moe": QWEN3_MOE_SPEC,
    "gemma3_text": GEMMA3_SPEC, "deepseek_v3": DEEPSEEK_V3_SPEC, "gpt_oss": GPT_OSS_SPEC,
}


def default_spec(model: torch.nn.Module) -> ProbeSpec:
    """The built-in spec for a model's architecture."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in DEFAULT_SPECS:
        raise UnsupportedModelError(
            f"no default probe spec for architecture {model_type!r}: pass spec=ProbeSpec(...) "
            f"(built-in: {', '.join(DEFAULT_SPECS)})")
    return DEFAULT_SPECS[model_type]

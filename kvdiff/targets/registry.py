"""The engines kvdiff can test, by name or through the user's own adapter (`adapter.py`), and how
each is started on a loaded model's checkpoint."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any, Callable, Mapping

from kvdiff.errors import InputError
from kvdiff.options import EngineWeights
from kvdiff.targets.adapter import AdapterEngine, EngineStart, load_adapter, start_adapter
from kvdiff.targets.protocol import Target


class EngineName(str, Enum):
    """`--engine`: kvdiff's own chunked engine, or an engine under test."""

    KVDIFF = "kvdiff"
    TRANSFORMERS = "transformers"
    VLLM = "vllm"
    LLAMACPP = "llama.cpp"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: "str | EngineName") -> "EngineName":
        """The engine called `value`; InputError lists the known ones."""
        try:
            return cls(_ALIASES.get(str(value), value))
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise InputError(f"unknown engine {value!r}: use one of {names}") from None


_ALIASES = {"llamacpp": "llama.cpp", "llama-cpp": "llama.cpp"}


def parse_engine(value: "str | EngineName | AdapterEngine | Callable") -> "EngineName | AdapterEngine":
    """`--engine`: a built-in engine's name, `FILE.py:FACTORY` or `MODULE:FACTORY` (an adapter of
    the user's), or, from Python, the factory itself."""
    if isinstance(value, (EngineName, AdapterEngine)):
        return value
    if callable(value):
        return AdapterEngine(f"{getattr(value, '__module__', '?')}:{getattr(value, '__qualname__', '?')}", value)
    if isinstance(value, str) and ":" in value:
        return load_adapter(value)
    return EngineName.parse(value)


def open_target(name: "EngineName | AdapterEngine", model, tokenizer, weights: EngineWeights = EngineWeights.FLOAT32,
                options: Mapping[str, Any] | None = None) -> Target:
    """Start engine `name` on the checkpoint `model` was loaded from (the same files, so the same
    weights and tokenizer as kvdiff's reference path). `weights` NATIVE runs a GGUF as it is
    (quantized); FLOAT32 runs llama.cpp on a float32 copy, the reference's values. vLLM and
    transformers load the reference's float32 checkpoint either way. `options`: the engine's own
    settings (options.engine_options): vllm.LLM's arguments, llama_cpp.Llama's, or transformers'
    ContinuousBatchingConfig's fields, over kvdiff's; those its recording depends on are refused.
    An adapter's factory gets them as they are (`EngineStart`)."""
    folder: Path | None = getattr(model, "kvdiff_folder", None)
    if isinstance(name, AdapterEngine):
        if weights is not EngineWeights.FLOAT32:
            raise InputError(f"--engine-weights native applies to llama.cpp: the adapter {name} loads what it loads")
        return start_adapter(name, EngineStart(model, tokenizer, None if folder is None else Path(folder),
                                               dict(options or {})))
    if name is EngineName.TRANSFORMERS:
        from kvdiff.targets.transformers_cb import TransformersTarget

        return TransformersTarget(model, tokenizer, cb_args=options)
    if name is EngineName.VLLM:
        if folder is None:
            raise InputError("vLLM loads a checkpoint folder: give --model smollm2-135m, a transformers model "
                             "folder or a .gguf file, not a built-in tiny-* model")
        from kvdiff.targets.vllm import VllmTarget

        return VllmTarget(Path(folder), engine_args=options)
    if name is EngineName.LLAMACPP:
        gguf = getattr(model, "kvdiff_gguf", None)
        if gguf is None:
            raise InputError("llama.cpp runs a GGUF file: give --model smollm2-135m or a .gguf file, "
                             "not a transformers folder or a built-in tiny-* model")
        from kvdiff.targets.gguf_float import float32_gguf
        from kvdiff.targets.llamacpp import LlamaCppTarget

        return LlamaCppTarget(float32_gguf(Path(gguf)) if weights is EngineWeights.FLOAT32 else Path(gguf),
                              llama_args=options)
    raise InputError(f"engine {name} is kvdiff's own: run it without --engine")

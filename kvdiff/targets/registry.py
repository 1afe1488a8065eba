"""The engines kvdiff can test, by name, and how each is started on a loaded model's checkpoint."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

from kvdiff.errors import InputError
from kvdiff.targets.protocol import Target


class EngineName(str, Enum):
    """`--engine`: kvdiff's own chunked engine, or an engine under test."""

    KVDIFF = "kvdiff"
    TRANSFORMERS = "transformers"
    VLLM = "vllm"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: "str | EngineName") -> "EngineName":
        """The engine called `value`; InputError lists the known ones."""
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(m.value for m in cls)
            hint = " (llama.cpp has no adapter yet: see docs/engines.md)" if str(value).startswith("llama") else ""
            raise InputError(f"unknown engine {value!r}: use one of {names}{hint}") from None


def open_target(name: EngineName, model, tokenizer) -> Target:
    """Start engine `name` on the checkpoint `model` was loaded from (the same files, so the same
    weights and tokenizer as kvdiff's reference path)."""
    folder: Path | None = getattr(model, "kvdiff_folder", None)
    if name is EngineName.TRANSFORMERS:
        from kvdiff.targets.transformers_cb import TransformersTarget

        return TransformersTarget(model, tokenizer)
    if name is EngineName.VLLM:
        if folder is None:
            raise InputError("vLLM loads a checkpoint folder: give --model smollm2-135m, a transformers model "
                             "folder or a .gguf file, not a built-in tiny-* model")
        from kvdiff.targets.vllm import VllmTarget

        return VllmTarget(Path(folder))
    raise InputError(f"engine {name} is kvdiff's own: run it without --engine")

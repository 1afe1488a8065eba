"""Models loaded once and kept by the caller across runs (tests, benchmarks, a CI job comparing
many prompts): `compare(..., model_cache=...)` looks a model up by what it was loaded with."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelKey:
    """What a model was loaded with: `load_model`'s arguments."""

    name: str
    dtype: str = "float32"
    device: str = "cpu"
    device_map: str | None = None
    gpu_memory: str | None = None


def cached_model(cache: dict | None, key: ModelKey):
    """`(model, tokenizer)` for `key`: from `cache` when it holds it, else loaded (and kept in
    `cache` when one is given)."""
    from kvdiff.engine.loading import load_model

    if cache is not None and key in cache:
        return cache[key]
    loaded = load_model(key.name, dtype=key.dtype, device=key.device, device_map=key.device_map,
                        gpu_memory=key.gpu_memory)
    if cache is not None:
        cache[key] = loaded
    return loaded

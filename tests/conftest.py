"""Shared fixtures: tiny models for unit tests, the real default model for a few tests.

After each test, freed memory goes back to the system: glibc keeps the heap pages of freed
tensors smaller than its (self-raising) mmap threshold, so one process running the whole suite
grew by 0.1-0.7 GB a real-model test (4 GB after a dozen of them and 5.3 GB after the vLLM and
llama.cpp files, where malloc_trim gives 1.1-1.9 GB back).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import pytest

import kvdiff

SEED_SYSTEM = "You are a helpful assistant. Always answer in French."
SEED_PROMPT = "What is the capital of France?"
TRIM_ABOVE = 1 << 30        # resident bytes from which a test's freed heap is given back


def _libc_trim():
    """glibc's malloc_trim, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _libc_trim()


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


@pytest.fixture(autouse=True)
def _give_back_freed_memory():
    yield
    if _MALLOC_TRIM is not None and _resident_bytes() > TRIM_ABOVE:
        _MALLOC_TRIM(0)


@pytest.fixture(scope="session")
def default_model():
    """The bundled SmolLM2-135M-Instruct (converted and cached on first use)."""
    return kvdiff.load_model("smollm2-135m")


@pytest.fixture(scope="session", params=["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"])
def tiny_model(request):
    """Each tiny test model family in turn."""
    return kvdiff.load_model(request.param)


@pytest.fixture(scope="session")
def tiny_llama():
    return kvdiff.load_model("tiny-llama")


def assert_every_strategy_runs(model, tokenizer, strategy: str, numerics: str, messages: list, other: list) -> None:
    """A family's engine test: `messages`, then `other` sharing its system chunk, 6 tokens each;
    strategies none and prefix give the reference path's tokens, every reusing one hits the chunk."""
    import torch

    from kvdiff.engine import Engine
    from kvdiff.engine.numerics import exact_numerics
    from kvdiff.engine.reference import reference_generate

    outs = Engine(model, tokenizer, strategy=strategy, numerics=numerics).generate([messages, other], max_new_tokens=6)
    assert all(len(o.token_ids) == 6 for o in outs)
    if strategy in ("none", "prefix"):
        with exact_numerics(model) if numerics == "exact" else torch.no_grad():
            assert outs[0].token_ids == reference_generate(model, tokenizer, messages, 6).token_ids
    if strategy != "none":
        assert outs[1].chunks[0].cache == "hit"

"""Shared fixtures: tiny models for unit tests, the real default model for a few tests."""

from __future__ import annotations

import pytest

import kvdiff

SEED_SYSTEM = "You are a helpful assistant. Always answer in French."
SEED_PROMPT = "What is the capital of France?"


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

"""Random-initialised models of real shapes, for GPU tests and benchmarks.

The GPU machines cannot receive the default model's weights (files over 64 MiB do not travel),
so GPU work runs on models with the real architecture and sizes and seeded random weights. A
random model's tokens are arbitrary but deterministic, which is all bitwise comparisons need.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from kvdiff.engine.loading import parse_dtype, resolve_device
from kvdiff.errors import InputError, ModelLoadError

REAL_SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                         rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
                         tie_word_embeddings=True),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
                         tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
                         tie_word_embeddings=False),
}
DEFAULT_SHAPES = ("smollm2-135m", "llama-3.2-1b")     # the 8B shape on request: it takes minutes of device time


def shape_config(shape: str) -> LlamaConfig:
    """The LlamaConfig of a named real shape (see REAL_SHAPES)."""
    if shape not in REAL_SHAPES:
        raise InputError(f"unknown model shape {shape!r}: use one of {', '.join(REAL_SHAPES)}")
    return LlamaConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2, **REAL_SHAPES[shape])


def random_model(shape: str, tokenizer_dir: str | Path, dtype="bfloat16", device="cuda",
                 seed: int = 0):
    """`(model, tokenizer)`: a seeded random-initialised model of `shape` with the tokenizer
    saved in `tokenizer_dir` (it must have a chat template and fit the shape's vocabulary)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer in {tokenizer_dir}: {exc}") from exc
    config = shape_config(shape)
    if len(tokenizer) > config.vocab_size:
        raise InputError(f"tokenizer in {tokenizer_dir} has {len(tokenizer)} tokens, more than "
                         f"{shape}'s vocabulary of {config.vocab_size}")
    torch.manual_seed(seed)
    with torch.device(resolve_device(device)):   # initialise where it runs: a 1B model inits in seconds on a GPU
        model = LlamaForCausalLM(config)
    model = model.to(dtype=parse_dtype(dtype)).eval()
    model.kvdiff_source = f"random:{shape}:seed{seed}"
    return model, tokenizer

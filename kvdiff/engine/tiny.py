"""Tiny deterministic test models: random weights from a fixed seed, real architectures.

They share one small byte-level BPE tokenizer with a ChatML chat template, trained at build
time on a fixed corpus (so it has real merges, and merges across chunk boundaries can happen).
"""

from __future__ import annotations

import functools

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    Gemma3TextConfig,
    GptOssConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3MoeConfig,
)

from kvdiff.options import TINY_MODELS

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "You are a helpful assistant. Always answer in French.",
    "What is the capital of France? The capital of France is Paris.",
    "system user assistant: the quick brown fox jumps over the lazy dog.",
    "Chunked prefill reuses the key and value cache of a system prompt across requests.",
    "La capitale de la France est Paris. Bonjour, comment allez-vous ?",
    "Rotary position embeddings rotate queries and keys by their position in the sequence.",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000, lists: a, b, c; numbers and punctuation!",
]

TINY_FAMILIES: dict[str, type[PretrainedConfig]] = {name: getattr(transformers, config)
                                                     for name, config in TINY_MODELS.items()}

SEED = 1234


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok.to_str()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The shared tiny tokenizer: byte-level BPE, ChatML template, eos `<|im_end|>`."""
    from tokenizers import Tokenizer

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def tiny_config(name: str, num_layers: int = 3) -> PretrainedConfig:
    """The config of a tiny test model of family `name` (see TINY_FAMILIES)."""
    tok = tiny_tokenizer()
    common = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
    )
    cls = TINY_FAMILIES[name]
    if cls in (Qwen3Config, Qwen3MoeConfig, Gemma3TextConfig, GptOssConfig):
        common["head_dim"] = 16
    if cls is Gemma3TextConfig:    # every third layer global, the others sliding-window (512 positions)
        common.update(query_pre_attn_scalar=16, sliding_window=512,
                      layer_types=["full_attention" if (i + 1) % 3 == 0 else "sliding_attention"
                                   for i in range(num_layers)])
    if cls is Qwen3MoeConfig:      # every layer sparse: 8 experts of width 32, 2 chosen per token
        common.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[])
    if cls is GptOssConfig:        # sliding (128 positions) and global layers in turn, 8 experts of width 32, 2 a token
        common.update(sliding_window=128, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                      rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                           original_max_position_embeddings=64, rope_theta=150000.0),
                      layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)])
    if cls is DeepseekV3Config:    # MLA: a latent of 32 and a RoPE key of 8 a token (YaRN, interleaved pairs); layer 0
        # dense, then 8 routed experts in 4 groups (2 groups, then 2 experts chosen a token) beside a shared one
        common.update(num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                      v_head_dim=16, first_k_dense_replace=1, n_routed_experts=8, n_group=4, topk_group=2,
                      num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, rope_interleave=True,
                      rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0, mscale_all_dim=1.0,
                                           beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=512))
    if cls is MistralConfig:
        common["sliding_window"] = None
    return cls(**common)


def build_tiny_model(name: str, num_layers: int = 3, seed: int | None = None, **overrides):
    """A deterministic random-initialised model of family `name`, with the tiny tokenizer;
    `overrides` set config attributes (e.g. sliding_window=32) before the weights are drawn.

    Weights are drawn with a larger std than the default init so that different inputs give
    clearly different greedy tokens (the default 0.02 makes every output the same token).
    Each family has its own default seed, so that Llama and Mistral do not share weights.
    """
    if seed is None:
        seed = SEED + list(TINY_FAMILIES).index(name)
    config = tiny_config(name, num_layers)
    for key, value in overrides.items():
        setattr(config, key, value)
    config.initializer_range = 0.2
    tokenizer = tiny_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        if isinstance(config, GptOssConfig):    # its init zeroes the biases: draw them too, so they count
            for pname, param in model.named_parameters():
                if pname.endswith("bias"):
                    torch.nn.init.normal_(param, std=config.initializer_range)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.bos_token_id = None
    model.name_or_path = name
    model.eval()
    return model, tokenizer

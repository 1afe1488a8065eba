"""Engine speed per architecture family on the CPU: a random model of a mid-size shape per family
(the tiny tokenizer), kvdiff's engine against transformers `generate`; prints a table.

    /work/main/.venv/bin/python benchmarks/bench_families.py qwen3-moe

Two figures per family: the time to first token of a conversation whose ~2,000-token system
prompt the engine has cached (a prefix hit) against `generate`'s (which prefills it all), and
decode tokens/s at batch 1. Each is the best of REPEATS alternated runs (other jobs share the
machine). Random weights would stop early on the end-of-turn token: both sides generate a fixed
number of tokens.
"""

from __future__ import annotations

import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from kvdiff.conversation import render_prompt_ids  # noqa: E402
from kvdiff.engine import Engine  # noqa: E402
from kvdiff.engine.tiny import tiny_config, tiny_tokenizer  # noqa: E402

SYSTEM_2K = " ".join(f"Rule {i}: answer briefly, politely and in plain words." for i in range(60))
DECODE_TOKENS = 64
REPEATS = 3

# family -> (tiny model whose config is scaled up, the scaled shape)
SHAPES = {
    "qwen3-moe": ("tiny-qwen3-moe", dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                                         num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4,
                                         moe_intermediate_size=256, intermediate_size=1024)),
    "gemma3": ("tiny-gemma3", dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                                   head_dim=64, query_pre_attn_scalar=64, intermediate_size=2048, sliding_window=4096,
                                   layer_types=["full_attention" if i % 6 == 5 else "sliding_attention"
                                                for i in range(8)])),
    # MLA: per token and layer a latent of 128 and a RoPE key of 32 cached (head_dim and qk_head_dim follow
    # the RoPE and query widths: the config derives them once, at construction)
    "deepseek-v3": ("tiny-deepseek-v3", dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                                             num_key_value_heads=8, q_lora_rank=192, kv_lora_rank=128,
                                             qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, head_dim=32,
                                             qk_head_dim=96, n_routed_experts=32, n_group=4, topk_group=2,
                                             num_experts_per_tok=4, moe_intermediate_size=256, intermediate_size=1024)),
    # sliding-window (128 positions) and global layers in turn, attention sinks, 32 experts of width 256, 4 a token
    "gpt-oss": ("tiny-gpt-oss", dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                                     head_dim=64, num_local_experts=32, num_experts_per_tok=4, intermediate_size=256,
                                     sliding_window=128, layer_types=["sliding_attention" if i % 2 == 0 else
                                                                      "full_attention" for i in range(8)])),
}


def build(family: str):
    name, shape = SHAPES[family]
    config = tiny_config(name)
    for key, value in shape.items():
        setattr(config, key, value)
    config.max_position_embeddings = 8192
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    return model, tiny_tokenizer(), sum(p.numel() for p in model.parameters())


def conv(system: str, user: str):
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def hf_generate(model, tok, messages, new_tokens):
    ids = torch.tensor([render_prompt_ids(tok, messages)])
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def engine(model, tok) -> Engine:
    eng = Engine(model, tok, strategy="prefix")
    eng.stops = set()         # random weights: generate the full count
    return eng


def main(family: str) -> None:
    model, tok, params = build(family)
    msgs = conv(SYSTEM_2K, "What is the capital of France?")
    n_prompt = len(render_prompt_ids(tok, msgs))
    hf_generate(model, tok, msgs, 2)                    # warm-up
    hf_ttft, eng_ttft, hf_tps, eng_tps = float("inf"), float("inf"), 0.0, 0.0
    for _ in range(REPEATS):
        hf_ttft = min(hf_ttft, timed(lambda: hf_generate(model, tok, msgs, 1)))
        eng = engine(model, tok)
        eng.generate([conv(SYSTEM_2K, "Hi")], max_new_tokens=1)          # caches the system chunk
        out = eng.generate([msgs], max_new_tokens=1)[0]
        assert out.chunks[0].cache == "hit"
        eng_ttft = min(eng_ttft, out.stats.ttft_s)
        hf_all = timed(lambda: hf_generate(model, tok, msgs, DECODE_TOKENS))
        hf_tps = max(hf_tps, (DECODE_TOKENS - 1) / (hf_all - hf_ttft))
        out = engine(model, tok).generate([msgs], max_new_tokens=DECODE_TOKENS)[0]
        eng_tps = max(eng_tps, (out.stats.generated_tokens - 1) / (out.stats.total_s - out.stats.ttft_s))
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; {family}: {params / 1e6:.0f}M parameters, prompt {n_prompt} tokens")
    print(f"{'benchmark':58} {'generate':>10} {'engine':>10} {'ratio':>8}")
    print(f"{'TTFT (s), system chunk cached (prefix hit) vs generate':58} {hf_ttft:10.4f} {eng_ttft:10.4f} "
          f"{hf_ttft / eng_ttft:7.2f}x")
    print(f"{f'decode tokens/s, batch 1, {DECODE_TOKENS} tokens':58} {hf_tps:10.1f} {eng_tps:10.1f} "
          f"{eng_tps / hf_tps:7.2f}x")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "qwen3-moe")

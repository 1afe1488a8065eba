"""The reference path: continuous greedy generation with the transformers model itself."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

from kvdiff.conversation import Messages, check_fits, render_prompt_ids
from kvdiff.trace.sink import ProbeSink


@dataclass
class ReferenceOutput:
    """What the plain continuous path produced for one conversation."""

    input_ids: list[int]
    token_ids: list[int]
    text: str


def stop_token_ids(model, tokenizer) -> set[int]:
    """Token ids that end a turn: the generation config's eos ids and the tokenizer's eos."""
    stops: set[int] = set()
    eos = model.generation_config.eos_token_id
    if isinstance(eos, int):
        stops.add(eos)
    elif eos:
        stops.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        stops.add(int(tokenizer.eos_token_id))
    return stops


@functools.lru_cache(maxsize=None)
def cache_keyword(model_class: type) -> str:
    """The name under which `model_class`'s forward takes its KV cache: `cache` from transformers
    5.2x on (which warns on stderr, once a process, for the older `past_key_values`), else
    `past_key_values` (transformers 5.17-5.19, as the GPU machines and vLLM's pin have it)."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


@torch.no_grad()
def reference_generate(model, tokenizer, messages: Messages, max_new_tokens: int = 32,
                       sink: ProbeSink | None = None) -> ReferenceOutput:
    """Greedy continuous generation: one prefill of the whole prompt, then decode with HF's cache.

    With a `sink` (e.g. kvdiff.probes.hooks.ModelProbes), each forward is bracketed by
    `begin_forward(positions)` / `end_forward()` and each chosen token reported by `capture_step`.
    """
    from transformers import DynamicCache

    input_ids = render_prompt_ids(tokenizer, messages)
    context = getattr(model.config, "max_position_embeddings", None)
    if context is not None:
        check_fits(len(input_ids), max_new_tokens, int(context))
    stops = stop_token_ids(model, tokenizer)
    # Every layer's cache keeps every key at its position (no config: no layer drops keys that left
    # a sliding window); sliding-window layers still mask them out. Exact numerics align key tiles
    # to position 0, as the engine does, which a cache holding only the window's keys would shift.
    cache = DynamicCache()
    cache_arg = cache_keyword(type(model))
    step_input = torch.tensor([input_ids], device=model.device)
    start = 0
    generated: list[int] = []
    for step in range(max_new_tokens):
        positions = range(start, start + step_input.shape[1])
        if sink is not None:
            sink.begin_forward(positions)
        logits = model(input_ids=step_input, use_cache=True, **{cache_arg: cache}).logits
        token = int(logits[0, -1].argmax())
        if sink is not None:
            sink.end_forward()
            sink.capture_step(step, positions[-1], logits[0, -1], token)
        generated.append(token)
        if token in stops:
            break
        start = positions[-1] + 1
        step_input = torch.tensor([[token]], device=model.device)
    return ReferenceOutput(input_ids, generated, tokenizer.decode(generated, skip_special_tokens=True))

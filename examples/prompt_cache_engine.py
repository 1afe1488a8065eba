"""A small engine with a prompt cache: greedy generation with a transformers model that keeps the
KV cache of its last request and serves the longest common prefix of the next one from it (the
prompt reuse transformers documents as "Re-use cache to continue generation", and what
llama.cpp's server does for one slot). It knows nothing of kvdiff: `prompt_cache_adapter.py`
records it, as an adapter of your own engine would.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import DynamicCache


@dataclass
class Generation:
    """One request's outcome: the tokens and how many prompt tokens came from the cache."""

    token_ids: list[int]
    cached_tokens: int


class PromptCacheEngine:
    """Greedy decoding of one request at a time, reusing the previous request's cache."""

    def __init__(self, model, stop_ids: Sequence[int] = ()):
        self.model = model
        self.stop_ids = set(stop_ids)
        self.cache: DynamicCache | None = None
        self.cached_ids: list[int] = []      # the tokens whose K/V the cache holds, in order
        params = inspect.signature(type(model).forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def reset(self) -> None:
        """Forget the cached prefix."""
        self.cache, self.cached_ids = None, []

    def reuse(self, prompt_ids: Sequence[int]) -> int:
        """Keep the cache's longest common prefix with `prompt_ids` (all but the last prompt token
        at most: its logits are needed) and return its length."""
        common = 0
        for cached, new in zip(self.cached_ids, prompt_ids[:-1]):
            if cached != new:
                break
            common += 1
        if common == 0 or self.cache is None:
            self.cache, common = DynamicCache(), 0
        elif common < self.cache.get_seq_length():
            self.cache.crop(common - self.cache.get_seq_length())      # drop the rows past the common prefix
        self.cached_ids = self.cached_ids[:common]
        return common

    @torch.no_grad()
    def forward(self, token_ids: Sequence[int], start: int) -> torch.Tensor:
        """Logits (T, vocabulary) of `token_ids` at positions start..start+T-1, appended to the cache."""
        ids = torch.tensor([list(token_ids)], device=self.model.device)
        positions = torch.arange(start, start + len(token_ids), device=self.model.device).unsqueeze(0)
        out = self.model(input_ids=ids, position_ids=positions, use_cache=True, **{self._cache_arg: self.cache})
        self.cached_ids.extend(int(t) for t in token_ids)
        return out.logits[0]

    def on_token(self, step: int, position: int, logits: torch.Tensor, token: int) -> None:
        """Called for each generated token (a place for observers; nothing here)."""

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> Generation:
        """Greedy generation of up to `max_new_tokens` after `prompt_ids`."""
        prompt = [int(t) for t in prompt_ids]
        hit = self.reuse(prompt)
        logits = self.forward(prompt[hit:], hit)
        tokens: list[int] = []
        for step in range(max_new_tokens):
            position = len(prompt) + step - 1
            token = int(logits[-1].argmax())
            self.on_token(step, position, logits[-1], token)
            tokens.append(token)
            if token in self.stop_ids or step == max_new_tokens - 1:
                break
            logits = self.forward([token], position + 1)
        return Generation(tokens, hit)

"""The sampler: each request's next token from its logits, greedy or sampled."""

from __future__ import annotations

import torch


class Sampler:
    """Greedy when `temperature` is 0; else samples (seeded by `seed`) with optional top-k / top-p."""

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None):
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        self.generator = torch.Generator().manual_seed(seed if seed is not None else 0)

    def next_tokens(self, logits: list[torch.Tensor]) -> list[int]:
        """The next token of each logits row; greedy picks them all with one device call."""
        if self.temperature > 0:
            return [self._sample(row) for row in logits]
        return torch.stack(logits).argmax(-1).tolist() if logits else []

    def _sample(self, logits: torch.Tensor) -> int:
        scores = logits.float().cpu() / self.temperature
        if self.top_k > 0:
            kth = torch.topk(scores, min(self.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, -1)
        if self.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            cut = torch.cumsum(sorted_p, 0) - sorted_p >= self.top_p
            probs[order[cut]] = 0.0
            probs = probs / probs.sum()
        return int(torch.multinomial(probs, 1, generator=self.generator))

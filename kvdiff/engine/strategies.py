"""Chunk strategies: what a cached chunk's KV is computed from, and how it is placed on reuse.

| name | cached KV computed from | on reuse |
| none | nothing is cached: the whole prompt is prefilled per request | - |
| prefix | the chunk after all preceding chunks (the key chains the prefix) | read as is |
| isolated-local | the chunk alone at positions 0..n-1 | read as is |
| isolated-global | the chunk alone at its global positions | read as is |
| rerotate | the chunk alone at positions 0..n-1 | K re-rotated by the position delta |
| blend | as rerotate | re-rotated, then a fraction of tokens recomputed with full context |

Under every strategy but `prefix` the last chunk (the one whose last token gives the first
logits) is computed per request with full context and not cached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvdiff.engine.adapters import apply_rope
from kvdiff.options import DEFAULT_RECOMPUTE_RATIO, Strategy

BLEND_SELECT_LAYER = 1


@dataclass(frozen=True)
class StrategyRules:
    """A chunk strategy's behaviour, as flags the engine follows."""

    name: Strategy
    caches: bool          # chunks are kept in the registry
    chains_prefix: bool   # a chunk's key and KV depend on the chunks before it
    isolated: bool        # a chunk's KV is computed from the chunk alone
    local: bool           # cached at positions 0..n-1 rather than at its global positions
    rerotates: bool       # K re-rotated to the global positions where the chunk is placed
    recompute_ratio: float = 0.0  # blend: fraction of reused tokens recomputed with full context

    def key_start(self, start: int) -> int | None:
        """The start position to put in the key: only where the cached KV depends on it."""
        return start if (self.isolated and not self.local) else None

    def encoded_start(self, start: int) -> int:
        return 0 if self.local else start


# caches, chains_prefix, isolated, local, rerotates
_RULES = {
    Strategy.NONE: (False, False, False, False, False),
    Strategy.PREFIX: (True, True, False, False, False),
    Strategy.ISOLATED_LOCAL: (True, False, True, True, False),
    Strategy.ISOLATED_GLOBAL: (True, False, True, False, False),
    Strategy.REROTATE: (True, False, True, True, True),
    Strategy.BLEND: (True, False, True, True, True),
}


def make_strategy(strategy: Strategy, recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO) -> StrategyRules:
    """The rules of `strategy`; only blend keeps the recompute ratio."""
    ratio = float(recompute_ratio) if strategy is Strategy.BLEND else 0.0
    return StrategyRules(strategy, *_RULES[strategy], ratio)


def rerotate_keys(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate post-RoPE keys k (T, KVH, D) further by the angles whose cos/sin (T, D) are given.

    RoPE rotations compose: R(p + d) = R(d) R(p), so keys encoded at local position p land at
    p + d when rotated by the cos/sin of the delta d.
    """
    return apply_rope(k, cos, sin)


def select_blend_tokens(k_fresh: torch.Tensor, k_cached: torch.Tensor, ratio: float) -> torch.Tensor:
    """Indices (sorted) of the ceil(ratio * n) rows whose fresh K deviates most from the cached K."""
    n = k_fresh.shape[0]
    count = min(n, math.ceil(ratio * n - 1e-9))
    if count == 0:
        return torch.zeros(0, dtype=torch.long, device=k_fresh.device)
    deviation = (k_fresh.float() - k_cached.float()).reshape(n, -1).norm(dim=-1)
    return torch.sort(torch.topk(deviation, count).indices).values

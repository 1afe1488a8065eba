"""The capture sink: what every instrumented path (reference hooks, the engine) calls.

A path calls `begin_forward` before each model forward, `capture` at each probe point for the
rows it computes (or, for `k`/`v`, the rows attention reads), and `end_forward` after it.
Implementations copy tensors at capture time and check integrity at `end_forward`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Protocol, Sequence

import torch

from kvdiff.errors import KvdiffError


class ProbeIntegrityError(KvdiffError):
    """A probe fired zero or several times in a forward, or rows do not fit the trace."""


@dataclass(frozen=True)
class Provenance:
    """Where the K/V rows at some global positions came from (engine paths)."""

    chunk: str                    # chunk name: "system", "user", "user#2", "generation", "chunk3", "decode"
    prefill_id: int               # which engine forward computed them (0-based, per engine run)
    encoded_positions: Sequence[int]  # positions RoPE encoded them at
    reused: bool                  # read from the cache rather than computed in this request


class ProbeSink(Protocol):
    def wants(self, point: str, layer: int | None) -> bool:
        """Whether this sink records `point` at `layer`; paths skip work for points it does not want."""

    def begin_forward(self, positions: Sequence[int], reads_only: bool = False) -> None:
        """A forward over rows at these global positions (at least one) starts.

        `reads_only`: the bracket computes nothing; it records the `k`/`v` rows attention reads at
        these positions (reused cache rows, re-rotated placed rows), so only `k` and `v` fire.
        """

    def capture(self, point: str, layer: int | None, rows: torch.Tensor, positions: Sequence[int]) -> None:
        """Rows (T, ...) of probe `point` at `layer` (None for final points) at global `positions`
        (module hooks hand them with a leading batch dimension of one: (1, T, ...))."""

    def capture_norm(self, norm: str, layer: int | None, norm_input: torch.Tensor, norm_output: torch.Tensor,
                     positions: Sequence[int]) -> None:
        """A norm module's input and output rows; the sink computes the fp64 statistics."""

    def provenance(self, positions: Sequence[int], source: Provenance) -> None:
        """Record where the K/V at these positions came from."""

    def capture_step(self, step: int, position: int, logits_row: torch.Tensor, token_id: int) -> None:
        """A generated step: the logits row that chose `token_id` (the sink keeps top-k and margin)."""

    def end_forward(self) -> None:
        """The forward is over: every declared probe must have fired once per layer."""


class GraphDigestSink(ProbeSink, Protocol):
    """A sink that takes a forward's digests computed where its captures ran (the engine's
    forwards, and its decode graphs inside their steps), instead of the captures themselves."""

    def graph_digests(self, positions: Sequence[int]) -> Hashable | None:
        """The selection of what a forward at `positions` digests (it has `wants`), when that is
        all it records; None when its captures must reach `capture` as they run."""

    def take_digested(self, fired: list[tuple[str, int | None]], hashes: torch.Tensor, stats: torch.Tensor) -> None:
        """Inside a forward's bracket: what fired, in order ("stats:" + the norm for a norm's
        statistics), and the hashes (T, n) and statistics (T, n, 2) of its points' rows at its T
        positions."""

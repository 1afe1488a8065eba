"""blend checked position by position: the K error at every placed position, for blend and for the
isolated strategies it mends.

blend computes each cached chunk alone (as isolated-local does), re-rotates its K to the
chunk's global positions (what isolated-global computes directly, up to rounding) and
recomputes a share of the placed positions with full context. For a compare run of blend,
`blend_errors_section` runs blend, isolated-local and isolated-global once more each (cold, one
generated token, K recorded at the placed positions only) beside a reference forward, and gives
per placed position the largest rel of `k` over the layers (rel as in the heatmaps): a user
sees that the recomputed positions are mended (0 in exact numerics at ratio 1) and what the
others keep of isolated-global's error. It costs a reference prefill and three engine prefills
of the prompt: 1.7 s of a 9.3 s compare of the seeds' scenario on the default model and a 2-core CPU,
so it always runs for blend (docs/report-format.md, `blend_errors`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kvdiff.analysis.metrics import row_metrics
from kvdiff.engine import Engine
from kvdiff.engine.chunks import ChunkedPrompt, split_conversation
from kvdiff.engine.numerics import exact_numerics
from kvdiff.engine.reference import reference_generate
from kvdiff.conversation import Messages
from kvdiff.options import Numerics, Strategy
from kvdiff.probes.hooks import attach_probes
from kvdiff.run.options import RunOptions
from kvdiff.trace.sink import Provenance

STRATEGIES = (Strategy.BLEND, Strategy.ISOLATED_LOCAL, Strategy.ISOLATED_GLOBAL)
METRIC = "rel of k at the position, the largest over the layers"


class _KeySink:
    """A probe sink that keeps `k` rows (float32, on the host) and provenance at some positions."""

    def __init__(self, positions: Sequence[int]):
        self.positions = set(positions)
        self.rows: dict[tuple[int, int], torch.Tensor] = {}       # (layer, position) -> flattened row
        self.sources: dict[int, Provenance] = {}

    def wants(self, point: str, layer: int | None) -> bool:
        return point == "k"

    def begin_forward(self, positions: Sequence[int], reads_only: bool = False) -> None:
        pass

    def capture(self, point: str, layer: int | None, rows: torch.Tensor, positions: Sequence[int]) -> None:
        keep = [i for i, p in enumerate(positions) if int(p) in self.positions]
        if keep:      # the engine's rows are (T, KVH, D); the reference hooks' (1, T, KVH, D)
            flat = rows.reshape(len(positions), -1)
            picked = flat.index_select(0, torch.tensor(keep, device=rows.device)).float().cpu()
            for i, row in zip(keep, picked):
                self.rows[(int(layer), int(positions[i]))] = row

    def capture_norm(self, norm, layer, norm_input, norm_output, positions) -> None:
        pass

    def provenance(self, positions: Sequence[int], source: Provenance) -> None:
        for p in positions:
            self.sources[int(p)] = source

    def capture_step(self, step, position, logits_row, token_id) -> None:
        pass

    def end_forward(self) -> None:
        pass

    def stacked(self, positions: list[int]) -> np.ndarray:
        """(layers, positions, KVH * D) float32, over every layer that recorded k."""
        layers = sorted({layer for layer, _ in self.rows})
        return torch.stack([torch.stack([self.rows[(layer, p)] for p in positions]) for layer in layers]).numpy()


def _reference_keys(model, tokenizer, prompt: ChunkedPrompt, positions: list[int], exact: bool) -> np.ndarray:
    """The reference's k at `positions`, recorded as the reference trace records it."""
    sink = _KeySink(positions)
    with exact_numerics(model) if exact else contextlib.nullcontext(), attach_probes(model, sink) as probes:
        reference_generate(model, tokenizer, prompt.messages, 1, sink=probes)
    return sink.stacked(positions)


def _largest_rel(reference: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """Per position, the largest rel over the layers; reference, candidate (layers, P, width)."""
    rel = np.stack([row_metrics(r, c).rel for r, c in zip(reference, candidate)])
    return rel.max(axis=0)


def _recomputed(sink: _KeySink, placed: list[int], last: int) -> list[bool]:
    """Whether blend computed each placed position again in the last chunk's forward."""
    final = sink.sources[last].prefill_id
    return [sink.sources[p].prefill_id == final and not sink.sources[p].reused for p in placed]


def blend_errors(model, tokenizer, messages: Messages, options: RunOptions,
                 fingerprint: str | None = None) -> dict[str, Any] | None:
    """Per placed position, k's error against the reference under blend, isolated-local and
    isolated-global (the run's numerics, ratio and chunking); None without a placed position.
    `fingerprint`: the model's, where the caller has it (each engine would hash the weights)."""
    prompt = split_conversation(tokenizer, messages, chunk_size=options.chunk_size)
    placed = [p for c in prompt.chunks[:-1] for p in range(c.start, c.end)]
    if not placed:
        return None
    exact = options.numerics is Numerics.EXACT
    reference = _reference_keys(model, tokenizer, prompt, placed, exact)
    section: dict[str, Any] = {"point": "k", "metric": METRIC, "positions": placed}
    last = len(prompt) - 1
    for strategy in STRATEGIES:
        sink = _KeySink(placed)
        engine = Engine(model, tokenizer, strategy=strategy, numerics=options.numerics,
                        chunk_size=options.chunk_size, recompute_ratio=options.recompute_ratio,
                        fingerprint=fingerprint)
        engine.generate([prompt.messages], max_new_tokens=1, sinks={0: sink})
        errors = _largest_rel(reference, sink.stacked(placed))
        section[str(strategy)] = [float(e) if np.isfinite(e) else None for e in errors]
        if strategy is Strategy.BLEND:
            section["recomputed"] = _recomputed(sink, placed, last)
    return section


def blend_errors_section(model, tokenizer, messages: Messages, options: RunOptions,
                         step: Callable[[str], None], fingerprint: str | None = None) -> dict[str, Any]:
    """report.json's `blend_errors` key for a blend run ({} for any other strategy)."""
    if options.strategy is not Strategy.BLEND:
        return {}
    step("checking blend against isolated-local and isolated-global, position by position")
    return {"blend_errors": blend_errors(model, tokenizer, messages, options, fingerprint)}

"""The protocol an engine under test implements, so kvdiff can run it cold and warm and record it.

An adapter wraps one engine instance loaded from a transformers checkpoint folder. It runs
greedy requests given as token ids, tells how many prompt tokens the engine served from its
own cache (read from the engine's counters, never assumed), can drop that cache, and, when
handed a `ProbeSink`, records the probe points it can give from the engine's own tensors:

- `sink.begin_forward(positions)` / `sink.end_forward()` around each engine forward, per
  request (a packed batch is split per request; positions are the engine's own);
- `sink.capture(point, layer, rows, positions)` for each point in `points`; a point the engine
  cannot give is left out of `points`, never faked;
- K/V of positions the engine read from its cache: a `reads_only=True` bracket capturing `k`
  and `v` read from the paged cache through the request's block table, with
  `sink.provenance(positions, Provenance(chunk, block_id, positions, reused=True))`;
- `sink.capture_step(step, position, logits_row, token_id)` for each generated token.

Writing an adapter for another engine (SGLang, TRT-LLM, a fork of nano-vllm): implement this
class and a factory that starts it, and run `kvdiff compare --engine FILE.py:FACTORY`
(`adapter.py`; docs/engines.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from kvdiff.errors import InputError
from kvdiff.trace.sink import ProbeSink, Provenance


@dataclass(frozen=True)
class TargetInfo:
    """Which engine ran: its name, its package version and the checkpoint folder it loaded;
    `quantized`: the type of its weights where they are not the reference's (a GGUF's Q4_1), so
    that its projections differ from the reference's by quantization, not by a bug; `no_reuse`: why
    the engine shares no cached prefix with this model, where it cannot."""

    name: str
    version: str
    checkpoint: Path
    quantized: str | None = None
    no_reuse: str | None = None


@dataclass
class TargetRun:
    """One greedy request on an engine under test."""

    token_ids: list[int]
    text: str
    cache_hit_tokens: int              # prompt tokens the engine served from its cache (its own counter)
    margins: list[float] = field(default_factory=list)   # top-1 minus top-2 logit per generated step


class Target(Protocol):
    """An engine under test, loaded once, run request by request."""

    info: TargetInfo
    points: tuple[str, ...]            # probe points this engine can record (kvdiff.trace.points names)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, sink: ProbeSink | None = None) -> TargetRun:
        """Greedy decoding of `prompt_ids`; records into `sink` when one is given."""

    def reset_cache(self) -> None:
        """Drop every cached prefix, so the next request is computed cold."""

    def close(self) -> None:
        """Release the engine."""


def refuse_fixed(options: Mapping[str, Any] | None, fixed: Mapping[str, str], engine: str) -> None:
    """Refuse engine options that set what the target fixes for its recording (`fixed`: name -> why)."""
    given = sorted(set(options or {}) & set(fixed))
    if given:
        raise InputError(f"--engine-option {given[0]}: kvdiff sets it for the {engine} target ({fixed[given[0]]})")


def computed_provenance(sink: ProbeSink, positions: Sequence[int], encoded: Sequence[int], prompt_len: int,
                        forward: int) -> None:
    """The provenance of one forward's computed rows: chunk "prompt" before `prompt_len`, "decode"
    from it, each with the positions the engine handed its model (`encoded`, what RoPE encoded)."""
    for chunk, keep in (("prompt", lambda p: p < prompt_len), ("decode", lambda p: p >= prompt_len)):
        part = [p for p in positions if keep(p)]
        if part:
            sink.provenance(part, Provenance(chunk, forward, [e for p, e in zip(positions, encoded) if keep(p)], False))

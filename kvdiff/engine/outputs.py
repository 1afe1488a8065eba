"""What Engine.generate returns per request."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdiff.engine.chunks import SkippedMessage
from kvdiff.trace.format import ChunkRecord


@dataclass
class RequestStats:
    """Timings and token counts of one request."""

    ttft_s: float = 0.0           # generate() start to this request's first token
    total_s: float = 0.0          # generate() start to this request's last token
    prompt_tokens: int = 0
    reused_tokens: int = 0        # prompt tokens whose KV came from the cache
    prefilled_tokens: int = 0     # prompt rows run through the model (>= 1 even on a full hit)
    generated_tokens: int = 0


@dataclass
class RequestOutput:
    """One request's generation."""

    token_ids: list[int]
    text: str
    stats: RequestStats
    chunks: list[ChunkRecord]
    prompt_ids: list[int]
    skipped: list[SkippedMessage] = field(default_factory=list)

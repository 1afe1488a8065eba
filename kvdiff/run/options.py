"""One compare run's options as one frozen value, checked once where they enter (`RunOptions.of`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvdiff.errors import InputError
from kvdiff.options import DEFAULT_RECOMPUTE_RATIO, Numerics, Strategy, TraceMode, check_recompute_ratio
from kvdiff.trace.points import parse_points
from kvdiff.trace.ranges import check_ranges

MAX_NEW_TOKENS = 100_000


@dataclass(frozen=True)
class RunOptions:
    """What the engine and the probes of one compare run are asked to do."""

    strategy: Strategy = Strategy.PREFIX
    numerics: Numerics = Numerics.EXACT
    recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO
    chunk_size: int | None = None
    max_new_tokens: int = 16
    capture: tuple[str, ...] | None = None     # probe points kept (None: all)
    layers: str | None = None                  # '0-3,29': syntax checked here, range once the model is known
    trace_mode: TraceMode = TraceMode.DIGEST
    zoom_layers: int = 2                       # digest mode: the zoom window's layers and positions
    zoom_positions: int = 64

    @classmethod
    def of(cls, strategy: str | Strategy = Strategy.PREFIX, numerics: str | Numerics = Numerics.EXACT,
           max_new_tokens: int = 16, recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO,
           chunk_size: int | None = None, capture: str | None = None, layers: str | None = None,
           trace_mode: str | TraceMode = TraceMode.DIGEST, zoom_layers: int = 2,
           zoom_positions: int = 64) -> "RunOptions":
        """Options from a user (CLI, Python, a gate case), each checked before any model is loaded."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
            raise InputError(f"max_new_tokens must be between 1 and {MAX_NEW_TOKENS}, got {max_new_tokens}")
        if chunk_size is not None and chunk_size < 1:
            raise InputError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
        if isinstance(layers, str):
            check_ranges(layers, "layer")
        mode = TraceMode.parse(trace_mode)
        if mode is TraceMode.DIGEST and layers is not None:
            raise InputError("layers select what a full trace records; a digest trace digests every layer and "
                             "records a zoom window in full: size it with zoom_layers (--zoom-layers), or use "
                             "trace_mode full (--trace-mode full)")
        for name, value in (("zoom_layers", zoom_layers), ("zoom_positions", zoom_positions)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        return cls(Strategy.parse(strategy), Numerics.parse(numerics), check_recompute_ratio(recompute_ratio),
                   chunk_size, max_new_tokens, None if capture is None else parse_points(capture), layers,
                   mode, zoom_layers, zoom_positions)

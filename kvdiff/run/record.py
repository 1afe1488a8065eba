"""`kvdiff.record`: a probed continuous greedy generation of any supported transformers model."""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from typing import Iterable

from kvdiff.conversation import validate_messages
from kvdiff.engine.numerics import exact_numerics
from kvdiff.engine.reference import reference_generate
from kvdiff.options import Numerics, TraceMode
from kvdiff.probes.hooks import attach_probes
from kvdiff.probes.recorder import TraceRecorder
from kvdiff.probes.spec import ProbeSpec

log = logging.getLogger(__name__)


def record(model, tokenizer, messages: list[dict], path: str | os.PathLike, max_new_tokens: int = 16,
           capture: str | Iterable[str] | None = None, layers: str | Iterable[int] | None = None,
           positions: str | Iterable[int] | None = None, spec: ProbeSpec | None = None,
           strategy: str = "reference", numerics: str = "fast", compression: str | None = None,
           fingerprint: str | None = None, trace_mode: str = "full", window_final: bool | None = None,
           key_positions: str | Iterable[int] | None = None) -> str:
    """Generate greedily with probes on and write the trace to `path`; returns the path.

    The model may be the user's own (changed weights or modules): `spec` maps its module names
    to probe points when the built-in spec for its architecture does not fit. `capture`,
    `layers` and `positions` select what is kept ('k,v', '0-3,29', ...); default everything.
    `fingerprint`: the model's `model_fingerprint` if the caller has it, else it is computed.
    `numerics`: "fast" (the model's own kernels, the default) or "exact" (batch-invariant: the
    numerics `kvdiff compare` uses by default, so a trace to diff against a compare run's
    candidate is recorded with numerics="exact").
    `trace_mode`: "full" (rows of everything selected) or "digest" (a hash and statistics of
    every row; full rows only in the window `layers` x `positions`, none by default, with the
    final points when `window_final`; None: when the window holds the last layer), and k and v of its
    layers at `key_positions` too (the keys attention read at the window's rows).
    """
    messages = validate_messages(messages)
    mode = TraceMode.parse(trace_mode)
    exact = Numerics.parse(numerics) is Numerics.EXACT
    recorder = TraceRecorder.for_model(model, tokenizer, messages, path, strategy=strategy, numerics=numerics,
                                       capture=capture, layers=layers, positions=positions, spec=spec,
                                       compression=compression, fingerprint=fingerprint,
                                       max_new_tokens=max_new_tokens, trace_mode=mode.value,
                                       window_final=window_final, key_positions=key_positions)
    try:
        with exact_numerics(model) if exact else nullcontext(), attach_probes(model, recorder, spec) as probes:
            out = reference_generate(model, tokenizer, messages, max_new_tokens, sink=probes)
        log.info("recorded %d prompt + %d generated tokens", len(out.input_ids), len(out.token_ids))
        return recorder.finish(out.token_ids, out.text)
    except BaseException:
        recorder.abort()
        raise

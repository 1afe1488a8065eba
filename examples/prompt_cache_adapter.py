"""kvdiff's adapter for `prompt_cache_engine.py`: an example of testing an engine kvdiff does not
ship, with no change to kvdiff.

    kvdiff compare --engine examples/prompt_cache_adapter.py:open_target \\
        --system "You are a helpful assistant." --prompt "What is the capital of France?"

`open_target` is the factory kvdiff calls with an `EngineStart` (kvdiff's loaded model and
tokenizer, the checkpoint folder, the `--engine-option` settings). The target starts the engine
on that model (in the same process, as an engine under test runs) and records it by wrapping
the engine's own `forward` and `on_token`: kvdiff's probe hooks on the transformers model give
the rows each forward computes, and the prefix the engine served from its cache is read back
from its cache for the `reads_only` bracket, so that kvdiff sees the K/V attention read there.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).parent))

from prompt_cache_engine import PromptCacheEngine  # noqa: E402

from kvdiff.engine.reference import stop_token_ids  # noqa: E402
from kvdiff.probes.hooks import attach_probes  # noqa: E402
from kvdiff.probes.model_meta import model_dims  # noqa: E402
from kvdiff.targets.adapter import EngineStart  # noqa: E402
from kvdiff.targets.protocol import TargetInfo, TargetRun  # noqa: E402
from kvdiff.trace.sink import ProbeSink, Provenance  # noqa: E402


class PromptCacheTarget:
    """The engine as kvdiff's `Target`: greedy requests, its own hit count, its cache recorded."""

    def __init__(self, start: EngineStart):
        if start.options:
            raise ValueError(f"this engine takes no options, got {', '.join(start.options)}")
        self.model, self.tokenizer = start.model, start.tokenizer
        self.engine = PromptCacheEngine(start.model, stop_token_ids(start.model, start.tokenizer))
        self.info = TargetInfo("prompt-cache", importlib.metadata.version("transformers"),
                               start.checkpoint or Path("."))
        self.points = model_dims(start.model).points()

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, sink: ProbeSink | None = None) -> TargetRun:
        engine = self.engine
        if sink is None:
            out = engine.generate(prompt_ids, max_new_tokens)
        else:
            with attach_probes(self.model, sink) as probes:
                engine.reuse, engine.forward, engine.on_token = self._recorded(probes)
                try:
                    out = engine.generate(prompt_ids, max_new_tokens)
                finally:
                    del engine.reuse, engine.forward, engine.on_token       # the class's methods again
        return TargetRun(out.token_ids, self.tokenizer.decode(out.token_ids, skip_special_tokens=True),
                         out.cached_tokens)

    def _recorded(self, probes):
        """The engine's reuse, forward and on_token, each telling `probes` what it did."""
        engine = self.engine
        reuse, forward, on_token = engine.reuse, engine.forward, engine.on_token

        def recorded_reuse(prompt_ids):
            hit = reuse(prompt_ids)
            if hit:
                self._record_cached(probes, hit)
            return hit

        def recorded_forward(token_ids, start):
            probes.begin_forward(range(start, start + len(token_ids)))
            logits = forward(token_ids, start)
            probes.end_forward()
            return logits

        def recorded_token(step, position, logits, token):
            probes.capture_step(step, position, logits, token)
            on_token(step, position, logits, token)

        return recorded_reuse, recorded_forward, recorded_token

    def _record_cached(self, probes, hit: int) -> None:
        """The K/V rows of the `hit` cached positions, as attention will read them, in a reads-only bracket."""
        cached = list(range(hit))
        probes.begin_forward(cached, reads_only=True)
        for layer, cache_layer in enumerate(self.engine.cache.layers):
            for point, rows in (("k", cache_layer.keys), ("v", cache_layer.values)):
                if probes.wants(point, layer):      # (1, kv_heads, T, head_dim) -> (T, kv_heads, head_dim)
                    probes.capture(point, layer, rows[0, :, :hit].transpose(0, 1), cached)
        probes.provenance(cached, Provenance("cache", 0, cached, reused=True))
        probes.end_forward()

    def reset_cache(self) -> None:
        self.engine.reset()

    def close(self) -> None:
        self.engine.reset()


def open_target(start: EngineStart) -> PromptCacheTarget:
    """kvdiff's entry point: `--engine examples/prompt_cache_adapter.py:open_target`."""
    return PromptCacheTarget(start)

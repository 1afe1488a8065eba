"""Target: transformers' own continuous batching (`generate_batch` over a `PagedAttentionCache`).

One persistent `ContinuousBatchingManager` serves every request, so its prefix cache (block
sharing, on by default; whole blocks only) survives between requests until `reset_cache`.
Each packed forward is split per request with the engine's `cu_seq_lens_q`, `position_ids` and
the batch processor's `requests_in_batch`; module hooks (the architecture's ProbeSpec) and a
wrapper around the attention function and the cache's update record the rows
(`transformers_cb_probes.py`). K/V of prompt positions served from the prefix cache are read
from the paged cache through the request's block table after each layer's cache update in its
first forward (what attention read). Not given: `logits` (the model only projects the rows that
pick a token).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from kvdiff.engine.loading import load_model
from kvdiff.errors import InputError, KvdiffError, UnsupportedModelError
from kvdiff.probes.model_meta import model_dims
from kvdiff.probes.spec import ProbeSpec, default_spec
from kvdiff.targets.protocol import TargetInfo, TargetRun, refuse_fixed
from kvdiff.targets.transformers_cb_probes import RunProbes, RunRequest
from kvdiff.trace.format import ModelDims
from kvdiff.trace.points import ALL_POINTS, FINAL_POINTS, KNOWN_POINTS, MOE_POINTS, POST_NORM_POINTS
from kvdiff.trace.sink import ProbeSink

log = logging.getLogger(__name__)

POINTS = tuple(p for p in ALL_POINTS if p != "logits")
_CB_LOGGER = "ContinuousBatchingLogger"


def _points(model, dims: ModelDims) -> tuple[str, ...]:
    """What the target records of `model`: every dense point but logits (the engine projects only
    the rows it samples), with a router in every layer the router's points, with post-norms those."""
    routed = dims.num_experts and all(hasattr(block.mlp, "gate") or hasattr(block.mlp, "router")
                                      for block in model.model.layers[:dims.num_layers])
    extra = (MOE_POINTS if routed else ()) + (POST_NORM_POINTS if dims.post_norms else ())
    return tuple(p for p in dims.points() if p in POINTS or p in extra)


class TransformersTarget:
    """transformers continuous batching as a kvdiff Target (see kvdiff.targets.protocol).

    `model`, `cache` (the PagedAttentionCache), `prefix_blocks` and `block_kv` are open so tests
    can plant bugs through transformers' own objects."""

    def __init__(self, folder_or_model, tokenizer=None, block_size: int = 16, num_blocks: int = 128,
                 max_batch_tokens: int = 512, spec: ProbeSpec | None = None, device: str = "cpu",
                 cb_args: Mapping[str, Any] | None = None):
        import transformers

        refuse_fixed(cb_args, {"use_async_batching": "each step is recorded as it runs"}, "transformers")

        if isinstance(folder_or_model, (str, os.PathLike)):      # float32, sdpa (CB runs sdpa and paged|eager)
            folder = Path(folder_or_model)
            model, loaded = load_model(str(folder), dtype="float32", device=device)
            tokenizer = tokenizer or loaded
        else:
            model, folder = folder_or_model, Path(str(getattr(folder_or_model, "name_or_path", "") or "model"))
            if tokenizer is None:
                raise InputError("TransformersTarget(model): pass the model's tokenizer too")
        dims = model_dims(model)
        if dims.latent_dim:
            raise UnsupportedModelError(
                "transformers' continuous batching caches multi-head latent attention's K and V expanded per "
                "head, not the latent kvdiff's traces hold: compare this model on kvdiff's own engine (no --engine)")
        self.model, self.tokenizer, self.spec = model.eval(), tokenizer, spec or default_spec(model)
        self.info = TargetInfo("transformers", transformers.__version__, folder)
        self.points: tuple[str, ...] = _points(model, dims)
        try:
            self.cb_config = transformers.ContinuousBatchingConfig(**{
                "page_size": block_size, "num_blocks": num_blocks, "max_batch_tokens": max_batch_tokens,
                "max_requests_per_batch": 64, "use_cuda_graph": False, **(cb_args or {}), "use_async_batching": False})
        except TypeError as exc:        # a name ContinuousBatchingConfig does not take
            raise InputError(f"--engine-option: {exc} (the transformers target's options are "
                             f"ContinuousBatchingConfig's fields)") from exc
        eos = model.generation_config.eos_token_id
        stops = {int(e) for e in ([eos] if isinstance(eos, int) else eos or [])}
        stops |= {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
        self.gen_config = transformers.GenerationConfig(do_sample=False, eos_token_id=sorted(stops) or -1)
        # generate_batch warns about persistent managers at every request
        self._quiet = lambda record: "persistent_manager=True" not in str(record.msg)
        logging.getLogger(_CB_LOGGER).addFilter(self._quiet)
        self.manager = self.cache = None
        try:
            self._start_manager()
        except (TypeError, ValueError) as exc:
            if not cb_args:
                raise
            raise InputError(f"--engine-option: transformers' continuous batching does not start with "
                             f"{dict(cb_args)}: {exc}") from exc
        if not self.cache.use_prefix_sharing:
            self.info = replace(self.info, no_reuse=(
                "transformers' continuous batching shares no prefix blocks for this model (its cache "
                "allocators cannot share them: a sliding-window layer, or allow_block_sharing off)"))

    def _start_manager(self) -> None:
        """A persistent manager (started and stopped with keep_for_next_session, all public API),
        which `generate_batch(persistent_manager=True)` then reuses, cache included."""
        self.manager = self.model.init_continuous_batching(generation_config=self.gen_config,
                                                           continuous_batching_config=self.cb_config)
        self.manager.warmup()                       # builds the batch processor and its cache here
        self.manager.start()
        with _collecting_new_objects_only():
            self.manager.stop(block=True, keep_for_next_session=True)
        self.cache = self.manager.batch_processor.cache
        self.hits: dict[str, int] = {}              # request id -> prompt tokens the prefix cache served
        search = self.cache.search_prefix_match

        def search_prefix_match(request_id, prompt_ids):
            self.hits[request_id] = n = search(request_id, prompt_ids)
            return n

        self.cache.search_prefix_match = search_prefix_match

    def reset_cache(self) -> None:
        """Drop every cached block and hash (the engine's own `PagedAttentionCache.reset`)."""
        if self.cache is not None:                  # else the next run starts a fresh engine anyway
            self.cache.reset()

    def close(self) -> None:
        with _collecting_new_objects_only():
            self.model.destroy_cached_continuous_batching_manager()
        logging.getLogger(_CB_LOGGER).removeFilter(self._quiet)
        self.manager = self.cache = None

    def prefix_blocks(self, prompt_ids: Sequence[int]) -> list[int]:
        """Physical ids of the cached blocks a request with `prompt_ids` would share (no side effect)."""
        return [b for a in self.cache.cache_allocators.values() for b in a.match_prefix_blocks(list(prompt_ids))]

    def block_kv(self, layer: int, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Writable views (block_size, kv_heads, head_dim) of K and V of one physical block at `layer`."""
        alloc = self.cache.layer_to_allocator[layer]
        k_pages, v_pages = alloc.get_cache_for_block_table(layer)
        page = block_id * (alloc.block_physical_stride // alloc.tokens_per_page)
        return k_pages[page], v_pages[page]

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, sink: ProbeSink | None = None) -> TargetRun:
        return self.generate_many([prompt_ids], max_new_tokens, [sink])[0]

    def generate_many(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      sinks: Sequence[ProbeSink | None] | None = None) -> list[TargetRun]:
        """Several greedy requests in one `generate_batch` call, packed into shared forwards."""
        sinks = list(sinks) if sinks is not None else [None] * len(prompts)
        layers = range(self.model.config.num_hidden_layers)
        for sink in filter(None, sinks):
            missing = [p for p in KNOWN_POINTS if p not in self.points
                       and any(sink.wants(p, i) for i in ([None] if p in FINAL_POINTS else layers))]
            if missing:
                raise InputError(f"transformers continuous batching cannot record {', '.join(missing)}: "
                                 f"capture only {','.join(self.points)}")
        if self.manager is None:
            self._start_manager()
        reqs = [RunRequest(p, s) for p, s in zip(prompts, sinks)]
        probes = RunProbes(self, reqs)
        try:
            with probes, _collecting_new_objects_only():
                out = self.model.generate_batch([r.prompt for r in reqs], generation_config=self.gen_config,
                                                persistent_manager=True, warmup=False, max_new_tokens=max_new_tokens)
        except Exception as exc:
            probes.error = probes.error or exc
        results = [out.get(r.rid) for r in reqs] if probes.error is None else []
        failure = probes.error or next((f"no result for request {r.rid}" if o is None else o.error
                                        for r, o in zip(reqs, results) if o is None or o.error), None)
        if failure is not None:
            self.model.destroy_cached_continuous_batching_manager()    # the next run gets a fresh, cold engine
            self.manager = None
            raise failure if isinstance(failure, KvdiffError) else \
                KvdiffError(f"transformers continuous batching failed: {failure}")
        return [self._finish(r, o.generated_tokens) for r, o in zip(reqs, results)]

    def _finish(self, req: RunRequest, tokens: list[int]) -> TargetRun:
        """Report the generated steps to the sink, with the engine's tokens."""
        if len(req.steps) != len(tokens):
            log.warning("request %s: %d logits rows for %d generated tokens", req.rid, len(req.steps), len(tokens))
        margins = []
        for step, ((position, row), token) in enumerate(zip(req.steps, tokens)):
            top = row.topk(min(2, row.numel())).values
            margins.append(float(top[0] - top[1]) if top.numel() > 1 else float("inf"))
            if req.sink is not None:
                req.sink.capture_step(step, position, row, int(token))
        hit = self.hits.get(req.rid, 0)
        log.info("request %s: %d prompt tokens, %d from the prefix cache, %d generated",
                 req.rid, len(req.prompt), hit, len(tokens))
        return TargetRun(list(tokens), self.tokenizer.decode(tokens, skip_special_tokens=True), hit, margins)


@contextlib.contextmanager
def _collecting_new_objects_only():
    """transformers' manager runs a full `gc.collect()` each time it stops (to free GPU memory), 0.2-0.3 s
    in a process holding a model: with every object made before the call frozen (`gc.freeze`), it
    walks only what the call made."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()

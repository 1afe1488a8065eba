"""Target: transformers' own continuous batching (`generate_batch` over a `PagedAttentionCache`).

One persistent `ContinuousBatchingManager` serves every request, so its prefix cache (block
sharing, on by default; whole blocks only) survives between requests until `reset_cache`.
Each packed forward is split per request with the engine's `cu_seq_lens_q`, `position_ids` and
the batch processor's `requests_in_batch`; module hooks (the architecture's ProbeSpec) and a
wrapper around the attention function record the rows. K/V of prompt positions served from
the prefix cache are read from the paged cache through the request's block table before its
first forward. Not given: `logits` (the model only projects the rows that pick a token).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Sequence

import torch

from kvdiff.engine.loading import load_model
from kvdiff.errors import InputError, KvdiffError
from kvdiff.probes.spec import ProbeSpec, default_spec
from kvdiff.targets.protocol import TargetInfo, TargetRun
from kvdiff.trace.points import ALL_POINTS, FINAL_POINTS
from kvdiff.trace.sink import ProbeSink, Provenance

log = logging.getLogger(__name__)

POINTS = tuple(p for p in ALL_POINTS if p != "logits")
_CB_LOGGER = "ContinuousBatchingLogger"


class _Request:
    """One request of a run: its sink and what the engine's forwards told about it."""

    def __init__(self, prompt: Sequence[int], sink: ProbeSink | None):
        self.prompt, self.sink, self.rid, self.forwards = [int(t) for t in prompt], sink, None, 0
        self.steps: list[tuple[int, torch.Tensor]] = []      # (position, logits row) per generated token


class TransformersTarget:
    """transformers continuous batching as a kvdiff Target (see kvdiff.targets.protocol).

    `model`, `cache` (the PagedAttentionCache), `prefix_blocks` and `block_kv` are open so tests
    can plant bugs through transformers' own objects."""

    def __init__(self, folder_or_model, tokenizer=None, block_size: int = 16, num_blocks: int = 128,
                 max_batch_tokens: int = 512, spec: ProbeSpec | None = None, device: str = "cpu"):
        import transformers

        if isinstance(folder_or_model, (str, os.PathLike)):      # float32, sdpa (CB runs sdpa and paged|eager)
            folder = Path(folder_or_model)
            model, loaded = load_model(str(folder), dtype="float32", device=device)
            tokenizer = tokenizer or loaded
        else:
            model, folder = folder_or_model, Path(str(getattr(folder_or_model, "name_or_path", "") or "model"))
            if tokenizer is None:
                raise InputError("TransformersTarget(model): pass the model's tokenizer too")
        self.model, self.tokenizer, self.spec = model.eval(), tokenizer, spec or default_spec(model)
        self.info = TargetInfo("transformers", transformers.__version__, folder)
        self.points: tuple[str, ...] = POINTS
        self.cb_config = transformers.ContinuousBatchingConfig(
            page_size=block_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens, max_requests_per_batch=64,
            use_async_batching=False, use_cuda_graph=False)
        eos = model.generation_config.eos_token_id
        stops = {int(e) for e in ([eos] if isinstance(eos, int) else eos or [])}
        stops |= {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
        self.gen_config = transformers.GenerationConfig(do_sample=False, eos_token_id=sorted(stops) or -1)
        # generate_batch warns about persistent managers at every request
        self._quiet = lambda record: "persistent_manager=True" not in str(record.msg)
        logging.getLogger(_CB_LOGGER).addFilter(self._quiet)
        self.manager = self.cache = None
        self._start_manager()

    def _start_manager(self) -> None:
        """A persistent manager (started and stopped with keep_for_next_session, all public API),
        which `generate_batch(persistent_manager=True)` then reuses, cache included."""
        self.manager = self.model.init_continuous_batching(generation_config=self.gen_config,
                                                           continuous_batching_config=self.cb_config)
        self.manager.warmup()                       # builds the batch processor and its cache here
        self.manager.start()
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
            missing = [p for p in ALL_POINTS if p not in self.points
                       and any(sink.wants(p, i) for i in ([None] if p in FINAL_POINTS else layers))]
            if missing:
                raise InputError(f"transformers continuous batching cannot record {', '.join(missing)}: "
                                 f"capture only {','.join(self.points)}")
        if self.manager is None:
            self._start_manager()
        reqs = [_Request(p, s) for p, s in zip(prompts, sinks)]
        probes = _Probes(self, reqs)
        try:
            with probes:
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

    def _finish(self, req: _Request, tokens: list[int]) -> TargetRun:
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


class _Probes:
    """Hooks for one run: each packed forward's rows go to the sinks of the requests in it."""

    def __init__(self, target: TransformersTarget, reqs: list[_Request]):
        self.t, self.reqs, self.error, self.handles, self.attn = target, reqs, None, [], None
        self.cache_update = None          # the cache whose `update` is wrapped on the instance
        self.views: list[tuple[ProbeSink, slice, list[int]]] = []     # (sink, its rows, positions) this forward
        self.segments: list[tuple[_Request, int, list[int], bool]] = []

    def __enter__(self) -> "_Probes":
        model, add = self.t.model, self.handles.append
        add(model.register_forward_pre_hook(self._guard(self._begin), with_kwargs=True))
        add(model.register_forward_hook(self._guard(self._end), with_kwargs=True))
        for rule, _, module, layer in self.t.spec.matches(model) if any(r.sink for r in self.reqs) else ():
            if rule.point in self.t.points:
                register = module.register_forward_pre_hook if rule.kind == "input" else module.register_forward_hook
                add(register(self._module_hook(rule, layer), with_kwargs=True))
        return self

    def _module_hook(self, rule, layer: int | None):
        """A hook recording the ProbeSpec rule's point (input, output, or norm output plus statistics)."""
        def hook(module, args, kwargs, *output):
            x = args[0] if args else kwargs.get("hidden_states")
            if rule.kind == "input":
                return self._capture(rule.point, layer, x)
            out = output[0][0] if isinstance(output[0], tuple) else output[0]
            self._capture(rule.point, layer, out, x if rule.kind == "norm" else None)
        return self._guard(hook)

    def __exit__(self, *exc) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        for handle in self.handles:
            handle.remove()
        if self.cache_update is not None:
            del self.cache_update.update
        if self.attn is not None and self.attn[1] is None:
            del ALL_ATTENTION_FUNCTIONS[self.attn[0]]
        elif self.attn is not None:
            ALL_ATTENTION_FUNCTIONS[self.attn[0]] = self.attn[1]

    def _guard(self, fn):
        """Keep the first error a hook raises (the engine turns it into failed requests)."""
        def hook(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except BaseException as exc:
                self.error = self.error or exc
                raise
        return hook

    def _wrap_attention(self, name: str) -> None:
        """Wrap the attention function the model looks up by name (the engine's paged one): q and k as
        attention reads them, before the engine writes k to its cache."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        key = name if name == "paged|eager" else name.removeprefix("paged|")
        inner, ids = ALL_ATTENTION_FUNCTIONS[key], {id(m) for m in self.t.model.modules() if hasattr(m, "layer_idx")}

        def attention(module, query, key_states, value, attention_mask, *args, **kwargs):
            if id(module) in ids and self.views:
                self._capture("q", module.layer_idx, query.transpose(1, 2))
            return inner(module, query, key_states, value, attention_mask, *args, **kwargs)

        self.attn = (key, ALL_ATTENTION_FUNCTIONS._local_mapping.get(key))
        ALL_ATTENTION_FUNCTIONS[key] = self._guard(attention)
        self._wrap_cache_update()

    def _wrap_cache_update(self) -> None:
        """Wrap the paged cache's `update` (on the instance): k as the forward computed it, the new
        rows only. The attention function cannot give it: from transformers 5.2x the attention
        module updates the cache before calling it and hands it every key the rows read, cached
        ones first (5.17-5.19 updated the cache inside it)."""
        cache = self.t.cache
        inner = cache.update

        def update(key_states, value_states, layer_idx, *args, **kwargs):
            if self.views:
                self._capture("k", layer_idx, key_states.transpose(1, 2))
            return inner(key_states, value_states, layer_idx, *args, **kwargs)

        cache.update = self._guard(update)
        self.cache_update = cache

    def _bind(self, state) -> _Request | None:
        """The run's request a RequestState is: by id once seen, first by its prompt."""
        req = next((r for r in self.reqs if r.rid == state.request_id), None) or \
            next((r for r in self.reqs if r.rid is None and r.prompt == list(state.initial_tokens)), None)
        if req is not None:
            req.rid = state.request_id
        return req

    def _begin(self, model, args, kwargs) -> None:
        if self.attn is None and any(r.sink for r in self.reqs):
            self._wrap_attention(model.config._attn_implementation)
        batch = self.t.manager.batch_processor.inputs_and_outputs.requests_in_batch
        cu, pos = kwargs["cu_seq_lens_q"].tolist(), kwargs["position_ids"].reshape(-1).tolist()
        self.views, self.segments = [], []
        for i, future in enumerate(batch):
            req = self._bind(future.state)
            if req is None:
                continue
            positions = pos[cu[i]:cu[i + 1]]
            if req.forwards == 0:
                self._cached(req, positions[0])
            if req.sink is not None:
                req.sink.begin_forward(positions)
                chunk = "prompt" if positions[0] < len(req.prompt) else "decode"
                req.sink.provenance(positions, Provenance(chunk, req.forwards, positions, False))
                self.views.append((req.sink, slice(cu[i], cu[i + 1]), positions))
            self.segments.append((req, cu[i + 1] - 1, positions, future.has_new_token))
            req.forwards += 1

    def _cached(self, req: _Request, first: int) -> None:
        """Before a request's first forward: K/V of the prompt positions the prefix cache served,
        read through its block table, in a reads-only bracket."""
        hit, sink = self.t.hits.get(req.rid, 0), req.sink
        if first != hit:
            log.warning("request %s: first forward at position %d, but the prefix cache served %d tokens",
                        req.rid, first, hit)
        if sink is None or hit == 0:
            return
        alloc = self.t.cache.layer_to_allocator[0]       # prefix sharing needs one full-attention group
        cached, size = list(range(hit)), alloc.tokens_per_page
        blocks = alloc.block_table[req.rid][:-(-hit // size)]
        sink.begin_forward(cached, reads_only=True)
        for layer in range(self.t.model.config.num_hidden_layers):
            for point, index in (("k", 0), ("v", 1)):
                if sink.wants(point, layer):
                    rows = torch.cat([self.t.block_kv(layer, b)[index] for b in blocks])[:hit]
                    sink.capture(point, layer, rows, cached)
        for n, block in enumerate(blocks):
            span = cached[n * size:(n + 1) * size]
            sink.provenance(span, Provenance("cache", int(block), span, True))
        sink.end_forward()

    def _capture(self, point: str, layer: int | None, rows: torch.Tensor, norm_input: torch.Tensor | None = None):
        """Each request's rows (1, T, ...) of the packed `rows` to its sink (and norm statistics)."""
        for sink, s, positions in self.views:
            if sink.wants(point, layer):
                sink.capture(point, layer, rows[:, s], positions)
                if norm_input is not None:
                    sink.capture_norm(point, layer, norm_input[:, s], rows[:, s], positions)

    def _end(self, model, args, kwargs, output) -> None:
        for sink, _, _ in self.views:
            sink.end_forward()
        self.views = []
        index = kwargs["logits_indices"].tolist()
        rows = output.logits[0] if "logits_to_keep" in kwargs else output.logits[0, index]
        for req, last, positions, has_token in self.segments:
            if has_token:
                req.steps.append((positions[-1], rows[index.index(last)].detach().float().clone()))

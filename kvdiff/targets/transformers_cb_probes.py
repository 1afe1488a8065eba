"""The hooks of one run of transformers' continuous batching target (`transformers_cb.py`): each
packed forward's rows go to the sinks of the requests in it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Sequence

import torch

from kvdiff.trace.sink import ProbeSink, Provenance

if TYPE_CHECKING:
    from kvdiff.targets.transformers_cb import TransformersTarget

log = logging.getLogger(__name__)


class RunRequest:
    """One request of a run: its sink and what the engine's forwards told about it."""

    def __init__(self, prompt: Sequence[int], sink: ProbeSink | None):
        self.prompt, self.sink, self.rid, self.forwards = [int(t) for t in prompt], sink, None, 0
        self.steps: list[tuple[int, torch.Tensor]] = []      # (position, logits row) per generated token


class RunProbes:
    """Hooks for one run: each packed forward's rows go to the sinks of the requests in it."""

    def __init__(self, target: "TransformersTarget", reqs: list[RunRequest]):
        self.t, self.reqs, self.error, self.handles, self.attn = target, reqs, None, [], None
        self.cache_update = None          # the cache whose `update` is wrapped on the instance
        self.views: list[tuple[ProbeSink, slice, list[int]]] = []     # (sink, its rows, positions) this forward
        self.segments: list[tuple[RunRequest, int, list[int], bool]] = []
        # requests whose first forward follows a cache hit: (request, cached positions, blocks, layer -> (k, v))
        self.reads: list[tuple[RunRequest, list[int], list[int], dict]] = []

    def __enter__(self) -> "RunProbes":
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
            self._capture(rule.point, layer, rule.rows(output[0], self.t.model.config), x if rule.kind == "norm" else None)
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
            out = inner(key_states, value_states, layer_idx, *args, **kwargs)
            for req, cached, blocks, rows in self.reads:       # what attention reads, this forward's writes made
                k, v = zip(*(self.t.block_kv(layer_idx, b) for b in blocks))
                rows[layer_idx] = (torch.cat(k)[:len(cached)].clone(), torch.cat(v)[:len(cached)].clone())
            return out

        cache.update = self._guard(update)
        self.cache_update = cache

    def _bind(self, state) -> RunRequest | None:
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
            # The rows' places in the sequence: the request's own count of tokens processed, which the
            # batch's preparation has already moved past these rows; position_ids are what RoPE encodes.
            end = future.state.position_offset
            positions, encoded = list(range(end - (cu[i + 1] - cu[i]), end)), pos[cu[i]:cu[i + 1]]
            if req.forwards == 0:
                self._cached(req, positions[0])
            if req.sink is not None:
                req.sink.begin_forward(positions)
                chunk = "prompt" if positions[0] < len(req.prompt) else "decode"
                req.sink.provenance(positions, Provenance(chunk, req.forwards, encoded, False))
                self.views.append((req.sink, slice(cu[i], cu[i + 1]), positions))
            self.segments.append((req, cu[i + 1] - 1, positions, future.has_new_token))
            req.forwards += 1

    def _cached(self, req: RunRequest, first: int) -> None:
        """Before a request's first forward: the prompt positions the prefix cache served and their
        blocks, whose K/V each layer's cache update then reads back (`_emit_reads`)."""
        hit = self.t.hits.get(req.rid, 0)
        if first != hit:
            log.warning("request %s: first forward at position %d, but the prefix cache served %d tokens",
                        req.rid, first, hit)
        if req.sink is None or hit == 0:
            return
        alloc = self.t.cache.layer_to_allocator[0]       # prefix sharing needs one full-attention group
        self.reads.append((req, list(range(hit)), alloc.block_table[req.rid][:-(-hit // alloc.tokens_per_page)], {}))

    def _emit_reads(self) -> None:
        """After the forward: each cached position's K/V as attention read them (once the forward
        wrote its own rows), in a reads-only bracket per request."""
        size = self.t.cache.layer_to_allocator[0].tokens_per_page
        for req, cached, blocks, rows in self.reads:
            sink = req.sink
            sink.begin_forward(cached, reads_only=True)
            for layer, kv in sorted(rows.items()):
                for point, row in zip(("k", "v"), kv):
                    if sink.wants(point, layer):
                        sink.capture(point, layer, row, cached)
            for n, block in enumerate(blocks):
                span = cached[n * size:(n + 1) * size]
                sink.provenance(span, Provenance("cache", int(block), span, True))
            sink.end_forward()
        self.reads = []

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
        self._emit_reads()
        index = kwargs["logits_indices"].tolist()
        rows = output.logits[0] if "logits_to_keep" in kwargs else output.logits[0, index]
        # the engine takes one logits row per request that gets a token, in batch order: the row it
        # samples from, whichever row of the request's it is (a wrong index is the engine's to answer for)
        picked = iter(rows)
        for req, _, positions, has_token in self.segments:
            if has_token:
                req.steps.append((positions[-1], next(picked).detach().float().clone()))

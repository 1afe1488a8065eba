"""The chunked-generation engine: chunking, registry, paged KV, strategies, batched decoding."""

from __future__ import annotations

import logging
import time
from typing import Mapping, Sequence

import torch

from kvdiff.engine.adapters import get_adapter
from kvdiff.engine.chunks import ChunkedPrompt, split_conversation
from kvdiff.engine.decode_graph import DecodeGraphs, graphs_apply
from kvdiff.engine.fast_decode import fast_numerics
from kvdiff.conversation import Messages, check_fits
from kvdiff.engine.kv_cache import BLOCK_SIZE, BlockPool, BlockTable
from kvdiff.engine.latent_cache import LatentPool
from kvdiff.engine.numerics import exact_numerics
from kvdiff.engine.outputs import RequestOutput
from kvdiff.engine.reference import stop_token_ids
from kvdiff.engine.registry import ChunkRegistry, RegistryStats
from kvdiff.trace.fingerprint import model_fingerprint
from kvdiff.engine.row_group import RowGroup
from kvdiff.engine.runner import ModelRunner
from kvdiff.engine.sampler import Sampler
from kvdiff.engine.planner import Planner, Request, Reused
from kvdiff.engine.strategies import BLEND_SELECT_LAYER, make_strategy, select_blend_tokens
from kvdiff.errors import InputError
from kvdiff.options import DEFAULT_RECOMPUTE_RATIO, Numerics, Strategy, check_recompute_ratio
from kvdiff.trace.sink import ProbeSink, Provenance

log = logging.getLogger(__name__)

DEFAULT_KV_BUDGET = 512 * 2**20      # on the host; on a GPU, a share of its free memory
GPU_KV_SHARE = 0.3


def kv_budget(device: torch.device) -> int:
    """The KV cache's default size: on a GPU, GPU_KV_SHARE of its free memory (as serving engines
    size theirs), at least DEFAULT_KV_BUDGET; elsewhere DEFAULT_KV_BUDGET."""
    if device.type != "cuda":
        return DEFAULT_KV_BUDGET
    free, _ = torch.cuda.mem_get_info(device)
    return max(DEFAULT_KV_BUDGET, int(free * GPU_KV_SHARE))


class Engine:
    """Chunked generation with a chunk registry over one transformers model.

    Greedy by default; `temperature > 0` samples (seeded by `seed`) with optional top-k / top-p.
    On a GPU, decode steps and a cache hit's few new rows replay CUDA graphs (decode_graph.py)
    unless `cuda_graphs=False` or a probe records them (a decode step whose probes record
    digests only replays a graph that digests its captures: digest_probes.py). `fingerprint`: the
    model's `model_fingerprint` where the caller has it (hashing the weights takes ~1 s for the
    default model on a CPU); computed otherwise.
    """

    def __init__(self, model, tokenizer, strategy: Strategy | str = Strategy.PREFIX,
                 numerics: Numerics | str = Numerics.FAST,
                 chunk_size: int | None = None, recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO,
                 kv_budget_bytes: int | None = None, allow_boundary_mismatch: bool = False,
                 seed: int | None = None, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 block_size: int = BLOCK_SIZE, cuda_graphs: bool = True, fingerprint: str | None = None):
        # A public entry point: names from Python callers are parsed here, once.
        strategy, numerics = Strategy.parse(strategy), Numerics.parse(numerics)
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
            raise InputError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.strategy = make_strategy(strategy, check_recompute_ratio(recompute_ratio))
        self.numerics = numerics
        self.chunk_size = chunk_size
        self.allow_boundary_mismatch = allow_boundary_mismatch
        self.sampler = Sampler(temperature, top_k, top_p, seed)
        self.adapter = get_adapter(model)
        a = self.adapter
        dtype = a.embed_tokens.weight.dtype
        device = a.embed_tokens.weight.device
        if kv_budget_bytes is None:
            kv_budget_bytes = kv_budget(device)
        devices = [layer.device for layer in a.layers]
        if a.latent_attention:     # MLA: the cache holds a latent and a RoPE key per token
            attention = [layer.latent for layer in a.layers]
            per_block = LatentPool.block_bytes(attention, dtype, block_size)
            self.pool = LatentPool(attention, kv_budget_bytes // per_block, dtype, device, block_size, devices)
        else:
            per_block = BlockPool.bytes_per_block(len(a.layers), a.num_kv_heads, a.head_dim, dtype, block_size)
            self.pool = BlockPool(len(a.layers), a.num_kv_heads, a.head_dim, kv_budget_bytes // per_block,
                                  dtype, device, block_size, layer_devices=devices)
        self.registry = ChunkRegistry(self.pool, per_block, kv_budget_bytes)
        self.runner = ModelRunner(a, self.pool, exact=numerics is Numerics.EXACT)
        self.graphs = DecodeGraphs(self.runner) if cuda_graphs and graphs_apply(self.runner) else None
        self.fingerprint = model_fingerprint(model) if fingerprint is None else fingerprint
        self.stops = stop_token_ids(model, tokenizer)
        self._forwards = 0

    @property
    def stats(self) -> RegistryStats:
        """Chunk registry counters (hits, misses, reused and stored tokens, evictions, collisions)."""
        return self.registry.stats

    def check_fits(self, prompt: ChunkedPrompt, max_new_tokens: int, where: str = "") -> None:
        """InputError when the prompt plus `max_new_tokens` would run past the model's context."""
        check_fits(len(prompt), max_new_tokens, self.adapter.max_positions, where)

    def _forward(self, groups: list[RowGroup], num_layers: int | None = None) -> list[torch.Tensor | None]:
        self._forwards += 1
        return self.runner.forward(groups, num_layers)

    def generate(self, conversations: Sequence[Messages], max_new_tokens: int = 32,
                 sinks: Mapping[int, ProbeSink] | None = None) -> list[RequestOutput]:
        """Generate a reply for each conversation; several at once, sharing cached chunks."""
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        sinks = dict(sinks or {})
        if any(i not in range(len(conversations)) for i in sinks):
            raise InputError(f"sinks keys must be request indices 0..{len(conversations) - 1}")
        prompts = [split_conversation(self.tokenizer, c, self.chunk_size, self.allow_boundary_mismatch)
                   for c in conversations]
        for i, p in enumerate(prompts):
            self.check_fits(p, max_new_tokens, f"request {i}: ")
        a = self.adapter
        numerics = (exact_numerics(self.model, a.exact_forwards, attention=False)
                    if self.numerics is Numerics.EXACT else fast_numerics(self.model, a.fast_forwards))
        requests = [Request(i, p, BlockTable(self.pool), sinks.get(i)) for i, p in enumerate(prompts)]
        planner = Planner(self.registry, self.strategy, self.fingerprint)
        start = time.perf_counter()
        try:
            # Probes keep captures by reference where tensors have version counters: not in inference mode.
            with numerics, torch.no_grad() if sinks else torch.inference_mode():
                self._prefill(requests, planner)
                planner.fresh = []
                self._decode(requests, max_new_tokens, start)
                if self.graphs is not None:
                    self.graphs.step_digests.flush()
        finally:
            if self.graphs is not None:
                self.graphs.step_digests.drop()     # a failed decode's: its traces are not finished
            for entry in planner.fresh:
                self.registry.discard(entry)
            for r in requests:
                for entry in r.entries:
                    self.registry.release(entry)
                r.table.release()
        return [RequestOutput(r.generated, self.tokenizer.decode(r.generated, skip_special_tokens=True),
                              r.stats, r.reports, r.prompt.prompt_ids, r.prompt.skipped) for r in requests]

    def _prefill(self, requests: list[Request], planner: Planner) -> None:
        s = self.strategy
        for r in requests:
            r.stats.prompt_tokens = len(r.prompt)
        if not s.caches:
            logits = self._forward([g for r in requests for g in planner.plan_whole(r, self._forwards)])
        elif s.chains_prefix:
            fid = self._forwards
            logits = self._prompt_forward([(r, planner.plan_prefix(r, fid)) for r in requests])
        else:
            fid = self._forwards
            chunk_groups = [g for r in requests for g in planner.plan_isolated(r, fid)]
            if chunk_groups:
                self._forward(chunk_groups)
            placed = [p for r in requests for p in r.placed]
            if placed:
                dev = self.pool.device
                # Every row of a chunk moves by the same delta: its placed start minus its encoded start.
                delta = torch.cat([torch.full((p.chunk.end - p.chunk.start,), p.chunk.start - p.encoded_start,
                                              device=dev, dtype=torch.long) for p in placed])
                self.runner.place(torch.cat([p.src for p in placed]), torch.cat([p.dst for p in placed]), delta)
            fid = self._forwards
            groups = [planner.final_group(r, fid) for r in requests]
            if s.recompute_ratio > 0:
                groups = self._blend(requests, groups)
            logits = self._forward(groups)
        rows = iter(lg for lg in logits if lg is not None)
        for r in requests:
            r.logits = next(rows)
        self._emit_reused(requests)

    def _blend(self, requests: list[Request], finals: list[RowGroup]) -> list[RowGroup]:
        """CacheBlend: recompute the reused tokens whose K at layer 1 deviates most, with full context."""
        scratch = [BlockTable(self.pool) for _ in requests]
        try:
            probes = []
            for r, t, final in zip(requests, scratch, finals):
                n = final.positions[0]
                seg = t.add_own(n)
                probes.append(RowGroup(list(r.prompt.prompt_ids[:n]), list(range(n)), list(range(n)),
                                       seg.slots, seg.slots, list(t.segments)))
            self._forward([g for g in probes if g.token_ids], num_layers=BLEND_SELECT_LAYER + 1)
            groups = []
            for r, t, final in zip(requests, scratch, finals):
                n = final.positions[0]
                own = torch.cat([p.dst for p in r.placed]) if r.placed else t.all_slots()[:0]
                # K as attention reads it (MLA's: expanded from the latents, not the RoPE key alone)
                fresh = self.pool.read(BLEND_SELECT_LAYER, t.all_slots()[:n])[0] if n else own
                cached = self.pool.read(BLEND_SELECT_LAYER, own)[0]
                chosen = select_blend_tokens(fresh, cached, self.strategy.recompute_ratio).tolist()
                chosen_set = set(chosen)
                tokens = [r.prompt.prompt_ids[p] for p in chosen] + final.token_ids
                slots = torch.cat([own[chosen], final.write_slots]) if chosen else final.write_slots
                positions = chosen + final.positions
                prov = [([p], Provenance(_chunk_at(r, p), final.provenance[0][1].prefill_id, [p], False))
                        for p in chosen] + final.provenance
                groups.append(RowGroup(tokens, positions, list(positions), slots, slots, final.segments, 0,
                                       True, r.sink, prov))
                r.stats.prefilled_tokens += len(chosen)
                r.reused = [_drop(u, chosen_set) for u in r.reused]
            return groups
        finally:
            for t in scratch:
                t.release()

    def _emit_reused(self, requests: list[Request]) -> None:
        """One k/v-only bracket per request with a sink, for KV it reads but did not compute."""
        for r in requests:
            reused = [u for u in r.reused if u.positions] if r.sink is not None else []
            if not reused:
                continue
            positions = [p for u in reused for p in u.positions]
            slots = torch.cat([u.slots for u in reused])
            r.sink.begin_forward(positions, reads_only=True)
            for u in reused:
                r.sink.provenance(u.positions, u.provenance)
            value = self.adapter.value_point
            for layer in range(len(self.adapter.layers)):
                if r.sink.wants("k", layer) or r.sink.wants(value, layer):
                    k, v = self.pool.rows(layer, slots)
                    if r.sink.wants("k", layer):
                        r.sink.capture("k", layer, k, positions)
                    if r.sink.wants(value, layer):
                        r.sink.capture(value, layer, v, positions)
            r.sink.end_forward()

    def _prompt_forward(self, planned: list[tuple[Request, list[RowGroup]]]) -> list[torch.Tensor | None]:
        """A `prefix` prompt forward; a CUDA graph's replay where its rows are few (a hit's new turn)."""
        if self.graphs is not None and (logits := self.graphs.prompt([(r.table, gs) for r, gs in planned])):
            self._forwards += 1
            return logits
        return self._forward([g for _, gs in planned for g in gs])

    def _decode_forward(self, groups: list[RowGroup]) -> list[torch.Tensor | None]:
        """A decode forward; a CUDA graph's replay where one applies."""
        if self.graphs is not None:
            if logits := self.graphs.decode(groups):
                self._forwards += 1
                return logits
            self.graphs.step_digests.flush()        # the eager step's brackets come after the held steps'
        return self._forward(groups)

    def _decode(self, requests: list[Request], max_new_tokens: int, start: float) -> None:
        step = 0
        while True:
            active = []
            live = [r for r in requests if not r.done]
            for r, token in zip(live, self.sampler.next_tokens([r.logits for r in live])):
                if r.sink is not None:
                    r.sink.capture_step(step, r.table.length - 1, r.logits, token)
                r.generated.append(token)
                now = time.perf_counter() - start
                if step == 0:
                    r.stats.ttft_s = now
                r.stats.total_s = now
                r.stats.generated_tokens = len(r.generated)
                if token in self.stops or len(r.generated) >= max_new_tokens:
                    r.done = True
                else:
                    active.append(r)
            if not active:
                return
            fid = self._forwards
            groups = []
            for r in active:
                pos = r.table.length          # decode continues from the true sequence length
                seg = r.table.add_own(1)
                groups.append(RowGroup([r.generated[-1]], [pos], [pos], seg.slots, seg.slots,
                                       list(r.table.segments), 0, True, r.sink,
                                       [([pos], Provenance("decode", fid, [pos], False))],
                                       key_slots=r.table.host_slots()))
            for r, lg in zip(active, self._decode_forward(groups)):
                r.logits = lg
            step += 1


def _chunk_at(req: Request, position: int) -> str:
    return next(c.name for c in req.prompt.chunks if c.start <= position < c.end)


def _drop(reused: Reused, positions: set[int]) -> Reused:
    keep = [i for i, p in enumerate(reused.positions) if p not in positions]
    idx = torch.tensor(keep, dtype=torch.long, device=reused.slots.device)
    prov = reused.provenance
    return Reused(reused.chunk, [reused.positions[i] for i in keep], reused.slots.index_select(0, idx),
                  Provenance(prov.chunk, prov.prefill_id, [prov.encoded_positions[i] for i in keep], prov.reused))

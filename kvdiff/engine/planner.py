"""Prefill planning: per request, which chunks hit the registry and which rows must be computed.

The plan of a request fills its block table (shared entry segments, own segments) and yields
row groups for the runner. Requests of one generate call are planned in order, so a chunk
missed by an earlier request is a hit for a later one: it is computed once, in the same
forward, and read by both (every layer writes KV before any attention reads it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvdiff.engine.chunks import Chunk, ChunkedPrompt
from kvdiff.engine.kv_cache import BlockTable, Segment
from kvdiff.engine.outputs import RequestStats
from kvdiff.trace.format import ChunkRecord
from kvdiff.engine.registry import CacheEntry, ChunkRegistry
from kvdiff.engine.row_group import RowGroup
from kvdiff.engine.strategies import StrategyRules
from kvdiff.trace.sink import ProbeSink, Provenance


@dataclass
class Reused:
    """Positions whose KV a request reads without computing them in its own forwards."""

    chunk: str
    positions: list[int]
    slots: torch.Tensor
    provenance: Provenance


@dataclass
class Placed:
    """A cached chunk copied into a request's own slots, K re-rotated from its encoded positions."""

    chunk: Chunk
    src: torch.Tensor
    dst: torch.Tensor
    encoded_start: int


@dataclass
class Request:
    """A request being served: its prompt, KV view, plan, and output so far."""

    index: int
    prompt: ChunkedPrompt
    table: BlockTable
    sink: ProbeSink | None
    stats: RequestStats = field(default_factory=RequestStats)
    entries: list[CacheEntry] = field(default_factory=list)
    reports: list[ChunkRecord] = field(default_factory=list)
    reused: list[Reused] = field(default_factory=list)
    placed: list[Placed] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None
    done: bool = False


def _group(req: Request, chunks: list[Chunk], write: torch.Tensor, encoded: list[int], fid: int,
           segments: list[Segment], lo: int = 0, logits: bool = False) -> RowGroup:
    tokens = [t for c in chunks for t in c.token_ids]
    positions = [p for c in chunks for p in range(c.start, c.end)]
    prov, at = [], 0
    for c in chunks:
        n = len(c.token_ids)
        prov.append((list(range(c.start, c.end)), Provenance(c.name, fid, encoded[at: at + n], False)))
        at += n
    return RowGroup(tokens, positions, encoded, write, write, list(segments), lo, logits, req.sink, prov)


class Planner:
    """Turns requests into row groups under one strategy, registering chunks as it goes."""

    def __init__(self, registry: ChunkRegistry, strategy: StrategyRules, fingerprint: str):
        self.registry = registry
        self.strategy = strategy
        self.fingerprint = fingerprint
        self.fresh: list[CacheEntry] = []   # entries inserted by the current plan (KV not yet written)

    def _key(self, chunk: Chunk, parent: str | None) -> str:
        s = self.strategy
        return self.registry.key(self.fingerprint, s.name, chunk.token_ids,
                                 parent if s.chains_prefix or not s.caches else None, s.key_start(chunk.start))

    def _lookup(self, req: Request, chunk: Chunk, key: str, fid: int) -> tuple[CacheEntry | None, bool]:
        """(entry, hit); entry None when the chunk cannot be cached (a hash collision holds its key)."""
        entry = self.registry.lookup(key, chunk.token_ids)
        hit = entry is not None
        if entry is None and not self.registry.has_key(key):
            entry = self.registry.insert(key, chunk.token_ids, self.strategy.encoded_start(chunk.start), fid)
            self.fresh.append(entry)
        if entry is not None:
            self.registry.acquire(entry)
            req.entries.append(entry)
        return entry, hit

    def _report(self, req: Request, chunk: Chunk, key: str, hit: bool, enc_start: int) -> None:
        n = len(chunk.token_ids)
        req.reports.append(ChunkRecord(chunk.name, chunk.positions, key, "hit" if hit else "miss",
                                       (enc_start, enc_start + n - 1)))
        if hit:
            req.stats.reused_tokens += n

    def plan_whole(self, req: Request, fid: int) -> list[RowGroup]:
        """`none`: the whole prompt prefilled into the request's own blocks."""
        parent = None
        for c in req.prompt.chunks:
            parent = self._key(c, parent)
            self._report(req, c, parent, False, c.start)
        seg = req.table.add_own(len(req.prompt))
        req.stats.prefilled_tokens = len(req.prompt)
        return [_group(req, req.prompt.chunks, seg.slots, list(range(len(req.prompt))), fid,
                       req.table.segments, logits=True)]

    def plan_prefix(self, req: Request, fid: int) -> list[RowGroup]:
        """`prefix`: every chunk cached under the chain of keys before it; misses computed in order."""
        parent = None
        todo: list[Chunk] = []
        write: list[torch.Tensor] = []
        for c in req.prompt.chunks:
            parent = self._key(c, parent)
            entry, hit = self._lookup(req, c, parent, fid)
            if entry is None:
                seg = req.table.add_own(len(c.token_ids))
            else:
                seg = req.table.add_shared(parent, entry.slots, entry.host_slots)
            if hit:
                positions = list(range(c.start, c.end))
                req.reused.append(Reused(c.name, positions, seg.slots,
                                         Provenance(c.name, entry.prefill_id, positions, True)))
            else:
                todo.append(c)
                write.append(seg.slots)
            self._report(req, c, parent, hit, c.start)
        last = req.prompt.chunks[-1]
        if todo and todo[-1] is last:
            req.stats.prefilled_tokens = sum(len(c.token_ids) for c in todo)
            slots = torch.cat(write)
            return [_group(req, todo, slots, [p for c in todo for p in range(c.start, c.end)], fid,
                           req.table.segments, logits=True)]
        groups = []
        if todo:
            slots = torch.cat(write)
            groups.append(_group(req, todo, slots, [p for c in todo for p in range(c.start, c.end)], fid,
                                 req.table.segments))
        # A fully cached prompt still computes its last token, for the first logits (its KV is not rewritten).
        pos = len(req.prompt) - 1
        tail = Chunk(last.name, (last.token_ids[-1],), pos)
        read = torch.tensor([req.table.slot_of(pos)], device=req.table.pool.device)
        group = _group(req, [tail], torch.full_like(read, -1), [pos], fid, req.table.segments, logits=True)
        group.read_slots = read
        group.writes = False
        group.provenance = [([pos], Provenance(last.name, fid, [pos], False))]
        groups.append(group)
        req.stats.prefilled_tokens = sum(len(c.token_ids) for c in todo) + 1
        return groups

    def plan_isolated(self, req: Request, fid: int) -> list[RowGroup]:
        """isolated-*, rerotate, blend: each chunk but the last computed alone and cached."""
        s = self.strategy
        groups = []
        for c in req.prompt.chunks[:-1]:
            key = self._key(c, None)
            entry, hit = self._lookup(req, c, key, fid)
            enc = s.encoded_start(c.start)
            encoded = list(range(enc, enc + len(c.token_ids)))
            positions = list(range(c.start, c.end))
            if entry is None:
                slots, prefill_id = req.table.scratch(len(c.token_ids)), fid
            else:
                slots, prefill_id = entry.slots, entry.prefill_id
            if not hit:
                groups.append(_group(req, [c], slots, encoded, fid, [Segment(c.start, slots, key)], lo=c.start))
                req.stats.prefilled_tokens += len(c.token_ids)
            if s.rerotates:
                placed = req.table.add_own(len(c.token_ids))
                req.placed.append(Placed(c, slots, placed.slots, enc))
                req.reused.append(Reused(c.name, positions, placed.slots,
                                         Provenance(c.name, prefill_id, positions, hit)))
                self._report(req, c, key, hit, c.start)
            else:
                req.table.add_shared(key if entry is not None else None, slots,
                                     entry.host_slots if entry is not None else None)
                if hit:
                    req.reused.append(Reused(c.name, positions, slots, Provenance(c.name, prefill_id, encoded, True)))
                self._report(req, c, key, hit, enc)
        return groups

    def final_group(self, req: Request, fid: int) -> RowGroup:
        """The last chunk, per request, attending to everything before it."""
        c = req.prompt.chunks[-1]
        enc = self.strategy.encoded_start(c.start) if not self.strategy.rerotates else c.start
        parent = None
        for prev in req.prompt.chunks:
            parent = self.registry.key(self.fingerprint, self.strategy.name, prev.token_ids, parent)
        self._report(req, c, parent, False, enc)
        seg = req.table.add_own(len(c.token_ids))
        req.stats.prefilled_tokens += len(c.token_ids)
        return _group(req, [c], seg.slots, list(range(enc, enc + len(c.token_ids))), fid,
                      req.table.segments, logits=True)

"""CUDA graphs for decode steps (and a cache hit's few new rows): the host out of the step.

A decode step runs the same kernels on the same shapes from one step to the next; only the
inputs change (each row's token, position, new slot and slot table). Launching them one by one
from Python costs the host 20-40 ms a step on an 8B model, several times the GPU's own time.
Here a step's whole forward (embedding, every layer with its K/V write and paged attention, the
final norm and the LM head) is captured once per batch bucket as a CUDA graph reading static
input buffers; each step copies its inputs into the buffers and replays the graph.

A step of B rows replays the graph of the smallest bucket of at least B rows; the rows past B
are padding: they read and write one scratch slot the graphs keep for themselves. Each window of
the model's layers has its own slot table (a windowed layer reads a row's last `window` keys),
as wide as the longest sequence the model allows, so one graph serves every length.

Every row reads its own list of keys, so the few rows a prompt computes after a cached prefix
(a cache hit's new turn) are graph rows too: row p reads the keys at positions 0..p, its
neighbours' among them (each layer writes every row's K/V before any row attends).

Graphs run only where they are equivalent to the eager step and need nothing from the host in
the middle of it: one CUDA device with the paged decode kernels (fast numerics', or exact ones',
which give each row the bits of the eager exact step), a model without routers (a router's
expert choice sizes its tensors from the data) or latent attention, and no probe recording
more than digests. A decode step whose probes record digests only (a digest trace outside its
zoom window) replays a graph of its own that digests every capture inside the step
(digest_probes.py). Anything else runs the eager forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Hashable

import numpy as np
import torch

from kvdiff.engine.attention_plan import ForwardAttention, WindowPlan
from kvdiff.engine.digest_probes import DigestProbes, digest_selection
from kvdiff.engine.kv_cache import BlockTable
from kvdiff.engine.paged_decode import PagedDecode
from kvdiff.engine.row_group import RowGroup
from kvdiff.engine.runner import ModelRunner
from kvdiff.engine.step_digests import StepDigests

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)     # batch sizes a graph is captured for; larger steps run eagerly


@dataclass
class GraphRow:
    """One row of a graphed forward: its token, the position RoPE encodes it at, the slots of
    every key it reads in sequence order (its own last) and whether it writes its K/V there."""

    token: int
    encoded: int
    key_slots: np.ndarray
    writes: bool = True


def decode_rows(groups: list[RowGroup]) -> list[GraphRow] | None:
    """A decode forward's rows; None where a row's keys are not known on the host."""
    if any(g.key_slots is None for g in groups):
        return None
    return [GraphRow(g.token_ids[0], g.encoded[0], g.key_slots) for g in groups]


def prompt_rows(planned: list[tuple[np.ndarray, list[RowGroup]]]) -> list[GraphRow] | None:
    """The rows of a `prefix` prompt forward (each row reads every key up to its own), each
    request's groups with its block table's host slots; None where a probe records."""
    rows: list[GraphRow] = []
    for slots, groups in planned:
        for g in groups:
            if g.sink is not None or g.lo:
                return None
            rows += [GraphRow(t, e, slots[:p + 1], g.writes) for t, p, e in zip(g.token_ids, g.positions, g.encoded)]
    return rows


def graphs_apply(runner: ModelRunner) -> bool:
    """Whether the runner's forwards can be graphed at all (`decode_rows` and `prompt_rows` check
    each forward)."""
    from kvdiff.engine import paged_kernel

    a = runner.adapter
    return (runner.pool.device.type == "cuda" and (not runner.exact or runner.paged_exact) and runner.pool.holds_kv
            and paged_kernel.available and not a.latent_attention
            and all(layer.router is None and layer.device == runner.pool.device for layer in a.layers))


class DecodeGraphs:
    """The graphs of one engine (its pool's addresses are baked into them), captured as needed."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.pool = runner.pool
        a = runner.adapter
        dev = self.pool.device
        n = BUCKETS[-1]
        # the table each window's layers read (exact numerics: every key, each window cut in the kernel)
        self.table_of = {w: None if runner.exact else w for w in a.windows}
        self.width = {t: min(a.max_positions, self.pool.num_blocks * self.pool.block_size) if t is None else t
                      for t in self.table_of.values()}
        self.tokens = torch.zeros(n, dtype=torch.long, device=dev)
        self.encoded = torch.zeros(n, dtype=torch.long, device=dev)
        self.new_slots = torch.zeros(n, dtype=torch.long, device=dev)
        self.tables = {w: torch.zeros(n, width, dtype=torch.long, device=dev) for w, width in self.width.items()}
        self.lengths = {t: torch.ones(n, dtype=torch.long, device=dev) for t in self.width}
        self.scratch_block: int | None = None    # held for the engine's life
        # (bucket, what its probes digest or None) -> the graph, its logits and its probes (None: not capturable)
        self.graphs: dict[tuple[int, Hashable | None],
                          tuple[torch.cuda.CUDAGraph, torch.Tensor, DigestProbes | None] | None] = {}
        self.memory = None        # one memory pool for every bucket's graph
        self.step_digests = StepDigests()       # graphed steps' digests, not yet handed to their sinks
        self._said_eager = False

    def prompt(self, planned: list[tuple[BlockTable, list[RowGroup]]]) -> list[torch.Tensor | None] | None:
        """The logits of each group that asks for them, of a `prefix` prompt forward (each
        request's block table and groups) replayed from a graph; None where it cannot be (more
        rows than a graph holds, or a probe recording)."""
        groups = [g for _, gs in planned for g in gs]
        if sum(len(g.token_ids) for g in groups) > BUCKETS[-1]:
            return None
        rows = prompt_rows([(table.host_slots(), gs) for table, gs in planned])
        if rows is None:
            return None
        logits = self.forward(rows)
        if logits is None:
            return None
        ends = np.cumsum([len(g.token_ids) for g in groups]) - 1
        return [logits[end] if g.logits else None for g, end in zip(groups, ends)]

    def decode(self, groups: list[RowGroup]) -> list[torch.Tensor] | None:
        """Each decode row's logits from a graph, its digests held for its sink (`step_digests`)
        where a probe records digests only; None where it cannot be (more rows than a graph
        holds, or a probe recording more than digests)."""
        rows = decode_rows(groups)
        if rows is None or len(rows) > BUCKETS[-1]:
            return None
        selections = {digest_selection(g.sink, g.positions) for g in groups} - {None}
        if not selections:
            return self.forward(rows)
        if len(selections) > 1 or False in selections:
            if not self._said_eager:
                log.info("probed decode steps recording more than digests run without CUDA graphs")
                self._said_eager = True
            return None
        replayed = self.replay(rows, selections.pop())
        if replayed is None:
            return None
        logits, probes = replayed
        self.step_digests.add(probes, groups)
        return logits

    def forward(self, rows: list[GraphRow]) -> list[torch.Tensor] | None:
        """The float32 logits of each row (at most BUCKETS[-1]), from a replayed graph (off CUDA
        the static step runs eagerly: how the tests check it on the CPU); None without a graph."""
        replayed = self.replay(rows, None)
        return None if replayed is None else replayed[0]

    def replay(self, rows: list[GraphRow], digested: Hashable | None) -> tuple[list[torch.Tensor],
                                                                              DigestProbes | None] | None:
        """`forward`, and with `digested` (what the rows' sinks digest) the probes that digested
        the step's captures; None where the bucket's graph could not be captured."""
        B = len(rows)
        bucket = next(b for b in BUCKETS if b >= B)
        self._fill(rows, bucket)
        if not self.tokens.is_cuda:
            probes = None if digested is None else DigestProbes(digested, bucket)
            return list(self._step(bucket, probes)[:B]), probes
        key = (bucket, digested)
        if key not in self.graphs:
            self.graphs[key] = self._capture(bucket, digested)
            self._fill(rows, bucket)      # the capture's warm-up steps ran on padding only
        if self.graphs[key] is None:
            return None
        graph, logits, probes = self.graphs[key]
        graph.replay()
        return list(logits[:B]), probes

    def _scratch_slot(self) -> int:
        if self.scratch_block is None:
            self.scratch_block = self.pool.allocate(1)[0]
        return self.scratch_block * self.pool.block_size

    def _fill(self, rows: list[GraphRow], bucket: int) -> None:
        """Copy the step's inputs into the static buffers: rows past `rows` are padding, one key
        (the scratch slot) each; a row that does not write writes the scratch slot."""
        scratch = self._scratch_slot()
        B = len(rows)
        head = np.zeros((3, bucket), dtype=np.int64)       # padding: token 0 at position 0, scratch slot
        head[0, :B] = [r.token for r in rows]
        head[1, :B] = [r.encoded for r in rows]
        head[2, :] = scratch
        head[2, :B] = [int(r.key_slots[-1]) if r.writes else scratch for r in rows]
        dev = self.tokens.device
        on_device = torch.from_numpy(head).to(dev)
        self.tokens[:bucket].copy_(on_device[0])
        self.encoded[:bucket].copy_(on_device[1])
        self.new_slots[:bucket].copy_(on_device[2])
        for w, width in self.width.items():
            keys = [r.key_slots if w is None else r.key_slots[-w:] for r in rows]
            longest = max(k.shape[0] for k in keys)
            table = np.full((bucket, longest + 1), scratch, dtype=np.int64)
            table[B:, 0] = 1
            for i, k in enumerate(keys):
                table[i, 0] = k.shape[0]
                table[i, 1:1 + k.shape[0]] = k
            packed = torch.from_numpy(table).to(dev)
            self.lengths[w][:bucket].copy_(packed[:, 0])
            self.tables[w][:bucket, :longest].copy_(packed[:, 1:])

    def _step(self, bucket: int, probes: DigestProbes | None = None) -> torch.Tensor:
        """One decode forward of `bucket` rows from the static buffers: the logits (bucket, vocab);
        `probes` digest its captures."""
        a = self.runner.adapter
        x = a.embed_tokens(self.tokens[:bucket])
        ropes = {kind: a.rope(x, self.encoded[:bucket], kind) for kind in a.rope_kinds}
        slots = self.new_slots[:bucket]
        exact = self.runner.exact
        plans = {w: WindowPlan([], PagedDecode(self.tables[t][:bucket], self.lengths[t][:bucket], slots, 0, exact,
                                               w if exact else None))
                 for w, t in self.table_of.items()}
        attention = ForwardAttention(plans, [slice(0, bucket)], slots)
        if probes is None:
            return a.lm_head(a.final_norm(self.runner.unprobed_layers(x, ropes, attention, slots))).float()
        x = self.runner.layers(x, ropes, attention, slots, None, slots, probes)
        normed = a.final_norm(x)
        logits = a.lm_head(normed).float()
        probes.final(list(range(bucket)), x, normed, logits)
        probes.digest()
        return logits

    def _capture(self, bucket: int, digested: Hashable | None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor,
                                                                    DigestProbes | None] | None:
        """Capture the bucket's step (after two warm-up steps on a side stream, which compile the
        kernels and let cuBLAS pick its algorithms) with every row padding; with `digested`, the
        step digests its captures. None where CUDA refused the capture (logged)."""
        self._pad(bucket)
        side = torch.cuda.Stream(self.tokens.device)
        side.wait_stream(torch.cuda.current_stream(self.tokens.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(bucket, None if digested is None else DigestProbes(digested, bucket))
        torch.cuda.current_stream(self.tokens.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.memory is None:
            self.memory = torch.cuda.graph_pool_handle()
        probes = None if digested is None else DigestProbes(digested, bucket)
        try:
            # thread-local: the trace writer's thread copies rows off the GPU meanwhile, which in the
            # default (global) mode fails there and invalidates the capture
            with torch.cuda.graph(graph, pool=self.memory, capture_error_mode="thread_local"):
                logits = self._step(bucket, probes)
        except RuntimeError as exc:     # the warm-up steps ran: the capture itself failed (CUDA's word for it)
            log.warning("could not capture a decode graph for %d rows (%s): those steps run eagerly", bucket,
                        str(exc).splitlines()[0])
            return None
        log.debug("captured a decode graph for %d rows%s", bucket, "" if probes is None else ", digesting its captures")
        return graph, logits, probes

    def _pad(self, bucket: int) -> None:
        """Make every row of the bucket padding (the scratch slot, one key)."""
        scratch = self._scratch_slot()
        self.new_slots[:bucket].fill_(scratch)
        for w in self.width:
            self.tables[w][:bucket, 0] = scratch
            self.lengths[w][:bucket].fill_(1)

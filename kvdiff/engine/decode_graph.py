"""CUDA graphs for fast-numerics decode steps: the host out of the step.

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

Graphs run only where they are equivalent to the eager step and need nothing from the host in
the middle of it: fast numerics on one CUDA device with the paged decode kernel, a model without
routers (a router's expert choice sizes its tensors from the data) or latent attention, and no
probe recording. Anything else runs the eager forward.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from kvdiff.engine.attention_plan import ForwardAttention, WindowPlan
from kvdiff.engine.paged_decode import PagedDecode
from kvdiff.engine.runner import ModelRunner, RowGroup

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)     # batch sizes a graph is captured for; larger steps run eagerly


def graphs_apply(runner: ModelRunner) -> bool:
    """Whether the runner's decode steps can be graphed at all (the per-step checks are in
    `DecodeGraphs.takes`)."""
    from kvdiff.engine import paged_kernel

    a = runner.adapter
    return (runner.pool.device.type == "cuda" and not runner.exact and runner.pool.holds_kv
            and paged_kernel.available and not a.latent_attention
            and all(layer.router is None and layer.device == runner.pool.device for layer in a.layers))


class DecodeGraphs:
    """The decode graphs of one engine (its pool's addresses are baked into them)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.pool = runner.pool
        a = runner.adapter
        dev = self.pool.device
        n = BUCKETS[-1]
        self.width = {w: min(a.max_positions, self.pool.num_blocks * self.pool.block_size) if w is None else w
                      for w in a.windows}
        self.tokens = torch.zeros(n, dtype=torch.long, device=dev)
        self.encoded = torch.zeros(n, dtype=torch.long, device=dev)
        self.new_slots = torch.zeros(n, dtype=torch.long, device=dev)
        self.tables = {w: torch.zeros(n, width, dtype=torch.long, device=dev) for w, width in self.width.items()}
        self.lengths = {w: torch.ones(n, dtype=torch.long, device=dev) for w in a.windows}
        self.scratch_block: int | None = None    # held for the engine's life
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.memory = None        # one memory pool for every bucket's graph

    def takes(self, groups: list[RowGroup]) -> bool:
        """Whether this decode forward can replay a graph: one row a group, no probe, a bucket."""
        return (len(groups) <= BUCKETS[-1] and all(g.key_slots is not None and g.sink is None for g in groups))

    def forward(self, groups: list[RowGroup]) -> list[torch.Tensor]:
        """The float32 logits row of each group, from a replayed graph."""
        B = len(groups)
        bucket = next(b for b in BUCKETS if b >= B)
        self._fill(groups, bucket)
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket)
            self._fill(groups, bucket)      # the capture's warm-up steps ran on padding only
        graph, logits = self.graphs[bucket]
        graph.replay()
        return list(logits[:B])

    def _scratch_slot(self) -> int:
        if self.scratch_block is None:
            self.scratch_block = self.pool.allocate(1)[0]
        return self.scratch_block * self.pool.block_size

    def _fill(self, groups: list[RowGroup], bucket: int) -> None:
        """Copy the step's inputs into the static buffers: rows past the groups are padding, one
        key (the scratch slot) each."""
        scratch = self._scratch_slot()
        B = len(groups)
        head = np.zeros((3, bucket), dtype=np.int64)       # padding: token 0 at position 0, scratch slot
        head[0, :B] = [g.token_ids[0] for g in groups]
        head[1, :B] = [g.encoded[0] for g in groups]
        head[2, B:] = scratch
        head[2, :B] = [int(g.key_slots[-1]) for g in groups]
        dev = self.tokens.device
        rows = torch.from_numpy(head).to(dev)
        self.tokens[:bucket].copy_(rows[0])
        self.encoded[:bucket].copy_(rows[1])
        self.new_slots[:bucket].copy_(rows[2])
        for w, width in self.width.items():
            keys = [g.key_slots if w is None else g.key_slots[-w:] for g in groups]
            longest = max(k.shape[0] for k in keys)
            table = np.full((bucket, longest + 1), scratch, dtype=np.int64)
            table[B:, 0] = 1
            for i, k in enumerate(keys):
                table[i, 0] = k.shape[0]
                table[i, 1:1 + k.shape[0]] = k
            packed = torch.from_numpy(table).to(dev)
            self.lengths[w][:bucket].copy_(packed[:, 0])
            self.tables[w][:bucket, :longest].copy_(packed[:, 1:])

    def _step(self, bucket: int) -> torch.Tensor:
        """One decode forward of `bucket` rows from the static buffers: the logits (bucket, vocab)."""
        a = self.runner.adapter
        x = a.embed_tokens(self.tokens[:bucket])
        ropes = {kind: a.rope(x, self.encoded[:bucket], kind) for kind in a.rope_kinds}
        slots = self.new_slots[:bucket]
        plans = {w: WindowPlan([], PagedDecode(self.tables[w][:bucket], self.lengths[w][:bucket], slots))
                 for w in self.width}
        attention = ForwardAttention(plans, [slice(0, bucket)], slots)
        x = self.runner.unprobed_layers(x, ropes, attention, slots)
        return a.lm_head(a.final_norm(x)).float()

    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture the bucket's step (after two warm-up steps on a side stream, which compile the
        kernels and let cuBLAS pick its algorithms) with every row padding."""
        self._pad(bucket)
        side = torch.cuda.Stream(self.tokens.device)
        side.wait_stream(torch.cuda.current_stream(self.tokens.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(bucket)
        torch.cuda.current_stream(self.tokens.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.memory is None:
            self.memory = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.memory):
            logits = self._step(bucket)
        log.debug("captured a decode graph for %d rows", bucket)
        return graph, logits

    def _pad(self, bucket: int) -> None:
        """Make every row of the bucket padding (the scratch slot, one key)."""
        scratch = self._scratch_slot()
        self.new_slots[:bucket].fill_(scratch)
        for w in self.width:
            self.tables[w][:bucket, 0] = scratch
            self.lengths[w][:bucket].fill_(1)

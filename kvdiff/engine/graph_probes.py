"""Probes inside a CUDA graph's decode step: every capture digested in the graph, the digests
handed to the sinks after each replay.

A digest trace's decode steps outside its zoom window keep a hash and two statistics of every
row (trace/digest.py), nothing else. A graphed step cannot call a sink, but it can hash: the
step keeps its captures by reference, stacks those of one row size and dtype, and hashes each
stack in one kernel, into outputs that every replay rewrites. After a replay each row's digests
go to its request's sink (`GraphDigestSink.take_digested`): a few calls a step, where an eager
probed step makes a call for each of its hundreds of captures and launches each kernel.
"""

from __future__ import annotations

from typing import Hashable

import torch

from kvdiff.trace.digest import gathered_row_digests, row_digests
from kvdiff.trace.sink import GraphDigestSink, ProbeIntegrityError


def graph_selection(group) -> Hashable | None | bool:
    """What a decode row group's sink digests in a graphed step: None without a sink, False where
    the sink records more than digests (the step runs eagerly), else its selection
    (`GraphDigestSink.graph_digests`)."""
    if group.sink is None:
        return None
    graph_digests = getattr(group.sink, "graph_digests", None)     # a GraphDigestSink's (isinstance costs ~20 us)
    selection = None if graph_digests is None else graph_digests(group.positions)
    return False if selection is None else selection


class GraphProbes:
    """The runner's probes (the interface of runner._Probes) for one decode step of the rows of a
    graph's bucket, whose sinks digest `selection` (an object with `wants(point, layer)`)."""

    active = True

    def __init__(self, selection):
        self.selection = selection
        self.fired: list[tuple[str, int | None]] = []   # after `digest`: the points in `hashes`' order, then the norms
        self._captured: list[tuple[tuple[str, int | None], torch.Tensor, int]] = []
        self._norms: list[tuple[str, int | None]] = []
        self._read: list[tuple[tuple[str, int], torch.Tensor, torch.Tensor]] = []     # (point, layer), cache, slots
        self.hashes: torch.Tensor | None = None     # (rows, points) int64, rewritten by each replay
        self.stats: torch.Tensor | None = None      # (rows, points, 2) float32

    def wants(self, point: str, layer: int | None) -> bool:
        return self.selection.wants(point, layer)

    def capture(self, point: str, layer: int | None, rows: torch.Tensor) -> None:
        if self.selection.wants(point, layer):
            self._captured.append(((point, layer), rows, rows._version))

    def read(self, pool, layer: int, slots: torch.Tensor, value_point: str) -> None:
        """The K and V rows attention reads at `slots`: hashed where the cache holds them, every
        layer's in one kernel at the step's end (`gathered_row_digests`)."""
        for point, table in (("k", pool.k[layer]), (value_point, pool.v[layer])):
            if self.selection.wants(point, layer):
                self._read.append(((point, layer), table, slots))

    def norm(self, name: str, layer: int | None, inp: torch.Tensor, out: torch.Tensor) -> None:
        """A norm's statistics are kept in the zoom window only: here it only fires."""
        if self.selection.wants(name, layer):
            self._norms.append(("stats:" + name, layer))

    def final(self, inp: torch.Tensor, normed: torch.Tensor, logits: torch.Tensor) -> None:
        """The final points of every row: the final norm's input and output, and the logits."""
        self.capture("final_norm", None, normed)
        self.norm("final_norm", None, inp, normed)
        self.capture("logits", None, logits)

    def digest(self) -> None:
        """Hash the step's captures, at its end (inside the graph while it is captured): one
        stack and one hash kernel for each row size and dtype."""
        changed = [key for key, rows, version in self._captured if rows._version != version]
        if changed:
            point, layer = changed[0]
            raise ProbeIntegrityError(f"the engine changed the captured rows of {point!r} at layer {layer} in place "
                                      "before its decode step ended: they cannot be digested at the step's end")
        groups: dict[tuple[int, torch.dtype], list[int]] = {}
        for i, (_, rows, _) in enumerate(self._captured):
            groups.setdefault((rows[0].numel(), rows.dtype), []).append(i)
        hashes, stats, order = [], [], []
        for members in groups.values():
            stacked = torch.stack([self._captured[i][1].reshape(len(self._captured[i][1]), -1) for i in members], 1)
            h, s = row_digests(stacked.view(-1, stacked.shape[2]))
            hashes.append(h.view(stacked.shape[0], len(members)))
            stats.append(s.view(stacked.shape[0], len(members), -1))
            order += members
        fired = [self._captured[i][0] for i in order]
        reads: dict[tuple, list[int]] = {}
        for i, (_, table, _) in enumerate(self._read):
            reads.setdefault((table.dtype, table.shape[1:], table.stride()), []).append(i)
        for members in reads.values():
            h, s = gathered_row_digests([self._read[i][1] for i in members], self._read[members[0]][2])
            hashes.append(h)
            stats.append(s)
            fired += [self._read[i][0] for i in members]
        self.hashes, self.stats = torch.cat(hashes, 1), torch.cat(stats, 1)
        self.fired = fired + self._norms
        self._captured, self._read = [], []        # the graph's outputs are the digests; the captures may go

    def hand_over(self, groups) -> None:
        """After the step: each row group's (one decode row's) digests to its sink, in the bracket
        the runner's probes make (begin_forward, provenance, the digests, end_forward)."""
        for i, g in enumerate(groups):
            if g.sink is None:
                continue
            sink: GraphDigestSink = g.sink      # graph_selection found its graph_digests
            sink.begin_forward(g.positions)
            for positions, source in g.provenance:
                sink.provenance(positions, source)
            sink.take_digested(self.fired, self.hashes[i], self.stats[i])
            sink.end_forward()

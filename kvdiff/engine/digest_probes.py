"""Probes for a forward whose sinks record digests only: its captures kept by reference and
hashed together, each sink's rows' digests handed to it after the forward.

A digest trace outside its zoom window keeps a hash and two statistics of every row
(trace/digest.py), nothing else. Handed to a sink one by one (row_probes.py), a prompt's capture
costs a few calls and a copy or a kernel launch: ~80 us of host time on an H100 host, hundreds of
captures a forward, which a small model's prompt forward does not hide. Here the forward keeps
its captures by reference, stacks those of one row size, dtype and device, and hashes each stack
in one kernel, whenever the held captures pass HELD_BYTES and at the forward's end; the K/V rows
attention reads are hashed where the cache holds them, every layer's in one kernel. Then each
sink gets its rows' digests in one call (`GraphDigestSink.take_digested`).

The engine's decode graphs run these probes inside a CUDA graph's step (decode_graph.py): a
graphed step cannot call a sink, but it can hash, into outputs that every replay rewrites.
"""

from __future__ import annotations

from typing import Hashable

import torch

from kvdiff.engine.kv_cache import BlockPool
from kvdiff.engine.row_probes import SinkView, begin_view
from kvdiff.trace.digest import gathered_row_digests, row_digests
from kvdiff.trace.sink import GraphDigestSink, ProbeIntegrityError, ProbeSink
from kvdiff.trace.staging import version_of

HELD_BYTES = 1 << 28        # captures held by reference before they are stacked and hashed

Key = tuple[str, int | None]


def digest_selection(sink: ProbeSink | None, positions: list[int]) -> Hashable | None | bool:
    """What `sink` digests in a forward at `positions`: None without a sink, False where it
    records more than digests, else its selection (`GraphDigestSink.graph_digests`)."""
    if sink is None:
        return None
    graph_digests = getattr(sink, "graph_digests", None)     # a GraphDigestSink's (isinstance costs ~20 us)
    selection = None if graph_digests is None else graph_digests(positions)
    return False if selection is None else selection


def forward_selection(views: list[SinkView]) -> Hashable | None:
    """The selection every sink of a forward digests, where each records digests only and all
    digest the same; else None (the forward's captures go to the sinks as they are made)."""
    selections = {digest_selection(view.sink, view.positions) for view in views}
    return selections.pop() if len(selections) == 1 and False not in selections else None


class DigestProbes:
    """The runner's probes (row_probes.RowProbes' interface) for a forward of `rows` rows whose
    sinks digest `selection` (an object with `wants(point, layer)`) and record nothing else.
    `end` hands `views` their rows' digests; a decode graph calls `digest` inside its step, and its
    rows' digests go to their sinks a batch of steps at a time (step_digests.py)."""

    active = True

    def __init__(self, selection, rows: int = 0, views: list[SinkView] = ()):
        self.selection = selection
        self.rows = rows
        self.views = list(views)
        self.fired: list[Key] = []      # after `digest`: the points in `hashes`' order, then the norms
        self.hashes: torch.Tensor | None = None     # (rows, points) int64 (a graph's: rewritten by each replay)
        self.stats: torch.Tensor | None = None      # (rows, points, 2) float32
        self._held: list[tuple[Key, torch.Tensor, int | None]] = []
        self._held_bytes = 0
        self._digested: list[tuple[list[Key], torch.Tensor, torch.Tensor]] = []     # keys, hashes, stats
        self._norms: list[Key] = []
        self._read: list[tuple[Key, torch.Tensor, torch.Tensor]] = []     # (point, layer), cache, slots

    def begin(self) -> None:
        """Nothing before the forward: each sink's bracket opens once its digests are ready."""

    def wants(self, point: str, layer: int | None) -> bool:
        return self.selection.wants(point, layer)

    def capture(self, point: str, layer: int | None, rows: torch.Tensor) -> None:
        if self.selection.wants(point, layer):
            self._held.append(((point, layer), rows, version_of(rows)))
            self._held_bytes += rows.numel() * rows.element_size()
            if self._held_bytes >= HELD_BYTES:
                self._digest_held()

    def read(self, pool: BlockPool, layer: int, slots: torch.Tensor, value_point: str) -> None:
        """The K and V rows attention reads at `slots`: on a GPU hashed where the cache holds them,
        every layer's in one kernel at the forward's end (`gathered_row_digests`); elsewhere
        gathered now and hashed with the other captures of their shape."""
        wanted = [(point, table) for point, table in (("k", pool.k[layer]), (value_point, pool.v[layer]))
                  if self.selection.wants(point, layer)]
        if wanted and not wanted[0][1].is_cuda:
            k, v = pool.rows(layer, slots)
            self.capture("k", layer, k)
            self.capture(value_point, layer, v)
            return
        self._read += [((point, layer), table, slots) for point, table in wanted]

    def norm(self, name: str, layer: int | None, inp: torch.Tensor, out: torch.Tensor) -> None:
        """A norm's statistics are kept in the zoom window only: here it only fires."""
        if self.selection.wants(name, layer):
            self._norms.append(("stats:" + name, layer))

    def final_rows(self) -> set[int]:
        """Every row, where the selection holds a final point."""
        wanted = self.selection.wants("final_norm", None) or self.selection.wants("logits", None)
        return set(range(self.rows)) if wanted else set()

    def final(self, order: list[int], inp: torch.Tensor, normed: torch.Tensor, logits: torch.Tensor) -> None:
        """The final norm's input and output and the logits of rows `order`: every row
        (`final_rows`) where the selection holds a final point."""
        self.capture("final_norm", None, normed)
        self.norm("final_norm", None, inp, normed)
        self.capture("logits", None, logits)

    def _digest_held(self) -> None:
        """Hash the held captures: one stack and one kernel for each shape, dtype and device."""
        changed = [key for key, rows, version in self._held if version is not None and rows._version != version]
        if changed:
            point, layer = changed[0]
            raise ProbeIntegrityError(f"the engine changed the captured rows of {point!r} at layer {layer} in place "
                                      "before its forward ended: they cannot be digested at the forward's end")
        groups: dict[tuple[torch.Size, torch.dtype, torch.device], list[int]] = {}
        for i, (_, rows, _) in enumerate(self._held):
            groups.setdefault((rows.shape, rows.dtype, rows.device), []).append(i)
        for (shape, _, _), members in groups.items():
            parts = [self._held[i][1] for i in members]
            stacked = parts[0].unsqueeze(1) if len(parts) == 1 else torch.stack(parts, 1)   # (rows, captures, ...)
            h, s = row_digests(stacked.reshape(shape[0] * len(parts), -1))
            self._digested.append(([self._held[i][0] for i in members], h.view(shape[0], len(parts)),
                                   s.view(shape[0], len(parts), -1)))
        self._held, self._held_bytes = [], 0

    def digest(self) -> None:
        """Hash the forward's captures, at its end (inside the graph while it is captured)."""
        self._digest_held()
        reads: dict[tuple, list[int]] = {}
        for i, (_, table, _) in enumerate(self._read):
            reads.setdefault((table.device, table.dtype, table.shape[1:], table.stride()), []).append(i)
        for members in reads.values():
            h, s = gathered_row_digests([self._read[i][1] for i in members], self._read[members[0]][2])
            self._digested.append(([self._read[i][0] for i in members], h, s))
        if self._digested:
            device = self._digested[0][1].device      # a model split across GPUs: its digests meet on one
            self.hashes = torch.cat([h.to(device) for _, h, _ in self._digested], 1)
            self.stats = torch.cat([s.to(device) for _, _, s in self._digested], 1)
        else:
            self.hashes, self.stats = torch.zeros(self.rows, 0, dtype=torch.int64), torch.zeros(self.rows, 0, 2)
        self.fired = [key for keys, _, _ in self._digested for key in keys] + self._norms
        self._digested, self._read = [], []     # the digests are the outputs; the captures may go

    def end(self) -> None:
        """After the forward: digest it and hand each view its rows' digests."""
        self.digest()
        for view in self.views:
            self._hand(view)

    def _hand(self, view: SinkView) -> None:
        """A view's bracket (begin_forward, provenance, its rows' digests, end_forward)."""
        sink: GraphDigestSink = view.sink       # forward_selection found its graph_digests
        begin_view(view)
        sink.take_digested(self.fired, self.hashes[view.span], self.stats[view.span])
        sink.end_forward()

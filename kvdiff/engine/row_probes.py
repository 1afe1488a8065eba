"""The runner's probes: a forward's captures routed to the sinks of the requests whose rows it
computes, each capture as it is made (digest_probes.py keeps them for a forward whose sinks
record digests only).

All rows of one request in a forward are consecutive (the engine builds groups so) and form one
begin_forward/end_forward bracket: a sink's view of the forward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvdiff.engine.kv_cache import BlockPool
from kvdiff.engine.row_group import RowGroup
from kvdiff.trace.sink import ProbeSink, Provenance


class SinkView(NamedTuple):
    """One sink's rows of a forward: its groups, their span of the forward's rows and positions."""

    sink: ProbeSink
    span: slice
    positions: list[int]
    groups: list[RowGroup]


def sink_views(groups: list[RowGroup], spans: list[slice], positions: list[int]) -> list[SinkView]:
    """Each sink's view of a forward over `groups` (at `spans` of its rows, at `positions`):
    consecutive groups of one sink merge into one view."""
    views: list[SinkView] = []
    for g, s in zip(groups, spans):
        if g.sink is None:
            continue
        if views and views[-1].sink is g.sink and views[-1].span.stop == s.start:
            merged = slice(views[-1].span.start, s.stop)
            views[-1] = SinkView(g.sink, merged, positions[merged], views[-1].groups + [g])
        else:
            views.append(SinkView(g.sink, s, positions[s], [g]))
    return views


def begin_view(view: SinkView) -> None:
    """Open a view's bracket: begin_forward at its positions and where its K/V came from."""
    open_bracket(view.sink, view.positions, [p for g in view.groups for p in g.provenance])


def open_bracket(sink: ProbeSink, positions: list[int], provenance: list[tuple[list[int], Provenance]]) -> None:
    """begin_forward at `positions`, then each (positions, source) of where their K/V came from."""
    sink.begin_forward(positions)
    for p, source in provenance:
        sink.provenance(p, source)


class RowProbes:
    """Hands each capture of a forward to the sinks that want it, sliced to their rows."""

    def __init__(self, views: list[SinkView], rows: int):
        """`views` of a forward of `rows` rows (none: nothing is recorded)."""
        self.views = views
        self.active = bool(views)
        # one sink's rows are the whole forward's (a decode step): captures go as they are, a slice
        # each costs more host time than the capture
        self.sliced = len(views) > 1 or (self.active and views[0].span != slice(0, rows))

    def begin(self) -> None:
        for view in self.views:
            begin_view(view)

    def wants(self, point: str, layer: int | None) -> bool:
        return any(view.sink.wants(point, layer) for view in self.views)

    def capture(self, point: str, layer: int, rows: torch.Tensor) -> None:
        for sink, s, pos, _ in self.views:
            if sink.wants(point, layer):
                sink.capture(point, layer, rows[s] if self.sliced else rows, pos)

    def read(self, pool: BlockPool, layer: int, slots: torch.Tensor, value_point: str) -> None:
        """The K and V rows attention reads at `slots` (each row's), for the sinks recording them."""
        if self.active and (self.wants("k", layer) or self.wants(value_point, layer)):
            k, v = pool.rows(layer, slots)
            self.capture("k", layer, k)
            self.capture(value_point, layer, v)

    def norm(self, name: str, layer: int, inp: torch.Tensor, out: torch.Tensor) -> None:
        for sink, s, pos, _ in self.views:
            if sink.wants(name, layer):
                sink.capture_norm(name, layer, inp[s] if self.sliced else inp, out[s] if self.sliced else out, pos)

    def final_rows(self) -> set[int]:
        """The rows whose final points some sink records."""
        rows: set[int] = set()
        for sink, s, _, _ in self.views:
            if sink.wants("final_norm", None) or sink.wants("logits", None):
                rows.update(range(s.start, s.stop))
        return rows

    def final(self, order: list[int], inp: torch.Tensor, normed: torch.Tensor, logits: torch.Tensor) -> None:
        """The final norm's input and output and the logits of the forward's rows `order`."""
        where = {r: n for n, r in enumerate(order)}
        for sink, s, pos, _ in self.views:
            if not (sink.wants("final_norm", None) or sink.wants("logits", None)):
                continue
            idx = [where[r] for r in range(s.start, s.stop)]
            run = slice(idx[0], idx[-1] + 1) if idx and idx == list(range(idx[0], idx[0] + len(idx))) else None

            def rows(t: torch.Tensor) -> torch.Tensor:   # the final modules may sit on different GPUs
                return t[run] if run is not None else t.index_select(0, torch.tensor(idx, device=t.device))

            if sink.wants("final_norm", None):
                sink.capture("final_norm", None, rows(normed), pos)
                sink.capture_norm("final_norm", None, rows(inp), rows(normed), pos)
            if sink.wants("logits", None):
                sink.capture("logits", None, rows(logits), pos)

    def end(self) -> None:
        for view in self.views:
            view.sink.end_forward()

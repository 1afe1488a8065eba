"""StepDigests: decode steps' digests held on the device, handed to their sinks a batch of steps
at a time.

A decode graph's step digests its captures into outputs that its next replay rewrites
(digest_probes.py). Handing them to a sink every step costs a bracket, a plan lookup and two
clones: ~130 us of host time on an H100 host, on a 135M model's ~2 ms step. Here each step copies
its rows of digests into its sink's buffer (two copies) and notes their position and provenance;
every STEPS_HELD steps, and before anything else reaches the sink (`flush`), the sink gets the
held steps as one forward over their positions.
"""

from __future__ import annotations

from kvdiff.engine.digest_probes import DigestProbes
from kvdiff.engine.row_group import RowGroup
from kvdiff.engine.row_probes import open_bracket
from kvdiff.trace.sink import GraphDigestSink, Provenance

STEPS_HELD = 64


class _Held:
    """One sink's held steps: their digests (rows of `hashes` and `stats`), positions and provenance."""

    def __init__(self, sink: GraphDigestSink, probes: DigestProbes):
        self.sink = sink
        self.fired = probes.fired
        self.hashes = probes.hashes.new_empty((STEPS_HELD, *probes.hashes.shape[1:]))
        self.stats = probes.stats.new_empty((STEPS_HELD, *probes.stats.shape[1:]))
        self.positions: list[int] = []
        self.provenance: list[tuple[list[int], Provenance]] = []


class StepDigests:
    """The digests of graphed decode steps, held per sink until `flush` (or STEPS_HELD steps)."""

    def __init__(self) -> None:
        self._held: dict[int, _Held] = {}       # by id(sink): a sink need not be hashable

    def add(self, probes: DigestProbes, groups: list[RowGroup]) -> None:
        """After a graph's replay: row i of `probes`' digests is group i's (one decode row's)."""
        for i, g in enumerate(groups):
            if g.sink is None:
                continue
            held = self._held.get(id(g.sink))
            if held is not None and held.fired is not probes.fired and held.fired != probes.fired:   # another layout
                self._hand(held)
                held = None
            if held is None:
                held = self._held[id(g.sink)] = _Held(g.sink, probes)
            n = len(held.positions)
            held.hashes[n].copy_(probes.hashes[i])
            held.stats[n].copy_(probes.stats[i])
            held.positions += g.positions
            held.provenance += g.provenance
            if n + 1 == STEPS_HELD:
                self._hand(held)

    def flush(self) -> None:
        """Hand every sink its held steps: before any other forward of theirs, and at the end of
        the decode."""
        for held in list(self._held.values()):
            self._hand(held)

    def drop(self) -> None:
        """Forget the held steps (of a decode that failed)."""
        self._held.clear()

    def _hand(self, held: _Held) -> None:
        """The held steps as one bracket (begin_forward, provenance, digests, end_forward)."""
        del self._held[id(held.sink)]
        n = len(held.positions)         # at least one: a sink's entry is made with its first step
        open_bracket(held.sink, held.positions, held.provenance)
        held.sink.take_digested(held.fired, held.hashes[:n], held.stats[:n])
        held.sink.end_forward()

"""Which chunk of the candidate a position belongs to: its provenance first, else its chunk table."""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

import numpy as np

from kvdiff.trace import ChunkRecord, ProvenanceRecords, TraceReader


@dataclass(frozen=True)
class ChunkLookup:
    """The candidate's chunk table and per-position provenance (either may be empty)."""

    table: list[ChunkRecord]
    positions: np.ndarray                     # the candidate's recorded positions
    provenance: ProvenanceRecords | None
    # first position of each chunk: the reader keeps tables in order and without overlaps, so the
    # chunk holding a position is found by bisection (a scan per position was quadratic)
    firsts: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "firsts", [rec.positions[0] for rec in self.table])

    @classmethod
    def of(cls, trace: TraceReader) -> "ChunkLookup":
        positions = trace.digest_positions if trace.meta.trace_mode == "digest" else trace.positions
        return cls(list(trace.meta.chunks), positions, trace.provenance_at(positions))

    def _row(self, position: int) -> int | None:
        i = int(np.searchsorted(self.positions, position))
        return i if i < self.positions.size and self.positions[i] == position else None

    def record(self, position: int) -> ChunkRecord | None:
        """The chunk-table row whose span holds `position`."""
        i = bisect_right(self.firsts, position) - 1
        return self.table[i] if i >= 0 and position <= self.table[i].positions[1] else None

    def chunk_of(self, position: int) -> str | None:
        row = self._row(position)
        if self.provenance is not None and row is not None and self.provenance.chunk[row]:
            return self.provenance.chunk[row]
        rec = self.record(position)
        return rec.name if rec else None

    def span(self, position: int) -> tuple[int, int] | None:
        """First and last position of the chunk holding `position` (table, else provenance run)."""
        rec = self.record(position)
        if rec is not None:
            return rec.positions
        row = self._row(position)
        if self.provenance is None or row is None or not self.provenance.chunk[row]:
            return None
        name, prefill = self.provenance.chunk[row], self.provenance.prefill_id[row]
        same = np.array([c == name for c in self.provenance.chunk]) & (self.provenance.prefill_id == prefill)
        lo = hi = row
        while lo > 0 and same[lo - 1]:
            lo -= 1
        while hi + 1 < same.size and same[hi + 1]:
            hi += 1
        return int(self.positions[lo]), int(self.positions[hi])

    def encoded_position(self, position: int) -> int | None:
        """The position the engine says RoPE encoded `position` at, if it reported provenance."""
        row = self._row(position)
        if self.provenance is None or row is None or self.provenance.encoded_position[row] < 0:
            return None
        return int(self.provenance.encoded_position[row])

    def cached(self, position: int) -> bool | None:
        """Whether the K/V at `position` came from the cache; None when the trace does not say."""
        row = self._row(position)
        if self.provenance is not None and row is not None and self.provenance.chunk[row]:
            return bool(self.provenance.reused[row])
        rec = self.record(position)
        return None if rec is None else rec.cache == "hit"

    def recomputed(self, prompt_length: int) -> tuple[list[int], int]:
        """Prompt positions of the chunks computed apart from the last one (placed: cached or
        computed alone) that the last chunk's forward computed again (blend's selective
        recompute), and how many placed positions there are; from provenance."""
        if self.provenance is None or prompt_length < 1 or self._row(prompt_length - 1) is None:
            return [], 0
        prompt = self.positions < prompt_length
        names = np.array(self.provenance.chunk, dtype=object)
        last = self._row(prompt_length - 1)
        final_forward = self.provenance.prefill_id[last]
        placed = prompt & (names != names[last]) & (names != "")
        again = placed & (self.provenance.prefill_id == final_forward) & ~np.asarray(self.provenance.reused, dtype=bool)
        return [int(p) for p in self.positions[again]], int(placed.sum())

"""The recorder's digest side: every capture's rows hashed where they are (trace/digest.py) and
the digests handed to the writer; what a digest trace records outside its zoom window."""

from __future__ import annotations

import numpy as np
import torch

from kvdiff.trace.digest import DIGEST_STATS, DigestBatch, row_digests
from kvdiff.trace.format import digest_path
from kvdiff.trace.writer import TraceWriter

# Captures of at least this many elements are hashed at once (a prefill's: the hash costs about
# what reading the rows costs); smaller ones wait for the end of the forward and go together.
HASH_AT_ONCE_ELEMENTS = 1 << 16


class DigestTaker:
    """Hashes the captures of each forward and writes their digests: `take` per capture,
    `end_forward` once the forward is over (before the writer commits it)."""

    def __init__(self, writer: TraceWriter):
        self.writer = writer
        self._batch = DigestBatch()
        self._pending: list[tuple[str, int | None, np.ndarray]] = []

    def take(self, point: str, layer: int | None, rows: torch.Tensor, positions: np.ndarray) -> None:
        """Digest `rows` (one row per position, any trailing shape) of `point` at `layer`."""
        rows = rows.reshape(positions.size, -1)
        if rows.numel() >= HASH_AT_ONCE_ELEMENTS:
            self._write(point, layer, positions, *row_digests(rows))
        else:
            self._batch.add(rows)
            self._pending.append((point, layer, positions))

    def end_forward(self) -> None:
        """Hash the forward's small captures together and write their digests."""
        if not self._pending:
            return
        for (point, layer, positions), digests in zip(self._pending, self._batch.digests()):
            self._write(point, layer, positions, *digests)
        self._pending = []

    def _write(self, point: str, layer: int | None, positions: np.ndarray, hashes: torch.Tensor,
               stats: torch.Tensor) -> None:
        self.writer.write_rows_at(digest_path(layer, point, "hash"), positions, hashes, (positions.size,))
        self.writer.write_rows_at(digest_path(layer, point, "stats"), positions, stats,
                                  (positions.size, len(DIGEST_STATS)))

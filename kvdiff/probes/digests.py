"""The recorder's digest side: every capture's rows hashed where they are (trace/digest.py) and
the digests handed to the writer, a row of a layer's points per position in each of its tables
(format.digest_tables); what a digest trace records outside its zoom window."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kvdiff.trace.digest import DIGEST_STATS, DigestBatch, row_digests
from kvdiff.trace.format import digest_path, digest_table_of
from kvdiff.trace.sink import ProbeIntegrityError
from kvdiff.trace.staging import version_of
from kvdiff.trace.writer import TraceWriter

# Captures of at least this many elements are hashed at once (a prefill's: the hash costs about
# what reading the rows costs); smaller ones wait for the end of the forward and go together.
HASH_AT_ONCE_ELEMENTS = 1 << 16


class DigestTaker:
    """Hashes the captures of each forward and writes their digests: `take` per capture,
    `end_forward` once the forward is over (before the writer commits it). A point of a table
    that did not fire in a forward has a zero hash and NaN statistics in its row."""

    def __init__(self, writer: TraceWriter, tables: dict[tuple[int | None, str], Sequence[str]]):
        """`tables`: (layer, table name) -> its columns (format.digest_tables)."""
        self.writer = writer
        self.columns = {key: {point: i for i, point in enumerate(points)} for key, points in tables.items()}
        self._batch = DigestBatch()
        self._taken: dict[tuple[int | None, str], dict[str, tuple | int]] = {}
        self._positions: np.ndarray | None = None
        # Small captures wait for the end of the forward by reference, as the writer's stage keeps
        # them: a capture's first one is cloned and watched, and those the model changed in place
        # before the forward ended are cloned from then on.
        self._seen: set[tuple[str, int | None]] = set()
        self._cloned: set[tuple[str, int | None]] = set()
        self._watched: list[tuple[str, int | None, torch.Tensor, int, bool]] = []

    def take(self, point: str, layer: int | None, rows: torch.Tensor, positions: np.ndarray) -> None:
        """Digest `rows` (one row per position, any trailing shape) of `point` at `layer`; every
        capture of a forward is at the same positions."""
        self._positions = positions
        rows = rows.reshape(positions.size, -1)
        taken = self._taken.setdefault((layer, digest_table_of(point)), {})
        if rows.numel() >= HASH_AT_ONCE_ELEMENTS:
            taken[point] = row_digests(rows)
            return
        key, version = (point, layer), version_of(rows)
        learning = key not in self._seen
        if version is not None and key not in self._cloned:
            self._watched.append((point, layer, rows, version, learning))
        if learning or version is None or key in self._cloned:
            self._seen.add(key)
            rows = rows.clone()
        taken[point] = self._batch.add(rows)

    def end_forward(self) -> None:
        """Hash the forward's small captures together and write each layer's digests."""
        if not self._taken:
            return
        for point, layer, rows, version, learning in self._watched:
            if rows._version == version:
                continue
            if not learning:
                raise ProbeIntegrityError(f"the model changed the captured rows of {point!r} at layer {layer} in "
                                          "place before its forward ended, after a forward where it did not: their "
                                          "digest is not of the rows it computed; leave that point out of the capture")
            self._cloned.add((point, layer))
        self._watched = []
        batched = self._batch.digests() if len(self._batch) else []
        positions = self._positions
        for (layer, table), taken in self._taken.items():
            columns = self.columns[layer, table]
            parts = {point: batched[d] if isinstance(d, int) else d for point, d in taken.items()}
            if list(parts) == list(columns):            # every point fired, in column order: one stack each
                hashes = torch.stack([h for h, _ in parts.values()], 1)
                stats = torch.stack([s for _, s in parts.values()], 1)
            else:
                device = next(iter(parts.values()))[0].device
                hashes = torch.zeros(positions.size, len(columns), dtype=torch.int64, device=device)
                stats = torch.full((positions.size, len(columns), len(DIGEST_STATS)), float("nan"), device=device)
                for point, (h, s) in parts.items():
                    hashes[:, columns[point]] = h
                    stats[:, columns[point]] = s
            self.writer.write_rows_at(digest_path(layer, table, "hash"), positions, hashes, tuple(hashes.shape))
            self.writer.write_rows_at(digest_path(layer, table, "stats"), positions, stats, tuple(stats.shape))
        self._taken = {}
        self._positions = None

"""TraceColumn and LatchingFile: a dataset being written, and the file HDF5 writes through.

HDF5 writes through a `LatchingFile` (h5py's file-object driver): an OS error (disk full, file
too large) is kept there instead of being returned to HDF5, and TraceFile raises it after the
call. HDF5 2.0 crashes the process when it closes a file after a failed write from its chunk
cache; this way it never sees one, and the unfinished file can be closed and deleted.

Rows that extend a dataset's last write (a decode step's one row per point) are held in memory
and written when they reach the end of an HDF5 chunk: one write per chunk instead of a
read-modify-write of the chunk per step. The rows held are at most about one chunk (1 MB) per
dataset; TraceFile's `flush` and `finish` write them. Because of that the file has no HDF5
chunk cache: HDF5 keeps one per dataset, and with one the last chunks of each of a trace's
hundreds of datasets (2 MB each) stayed in memory until the file was closed, and were only then
written, after the run instead of beside it.

An uncompressed dataset whose first rows are consecutive and start in its first chunk (every
dataset of a full capture) has its chunks allocated by HDF5 when its extent grows, without fill
values, and `TraceColumn` writes the rows' bytes into them itself with `os.pwrite`, in pieces
of at most 1 MB. For the 2.1 GB trace of a 2,461-token prompt on the GPU host, the writer thread
spent 1.1-1.3 s in HDF5's writes and spends 0.7 s this way (docs/benchmarks.md). Other
datasets (compressed, or a `positions=` selection far from position 0, whose earlier chunks
should stay unallocated) are written by HDF5.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import h5py
import numpy as np

_WRITE_BYTES = 1 << 20            # the most one system call writes (LatchingFile.pwrite)


@dataclass
class TraceColumn:
    """One dataset being written: its handle, facts h5py would look up on every call (its extent
    in rows, chunk rows), which positions hold rows, and the rows held back from `held_start`.

    A column with `io` has its chunks allocated when its extent grows (HDF5's early allocation)
    and writes its rows into them itself, at the chunks' byte offsets (`offsets`, one per chunk);
    one without goes through HDF5's own writes (compressed chunks, or rows that start far from
    position 0, whose unwritten chunks should stay unallocated)."""

    ds: h5py.Dataset
    row_shape: tuple[int, ...]
    dtype: np.dtype
    chunk_rows: int
    io: "LatchingFile | None" = None
    offsets: list[int] = field(default_factory=list)
    extent: int = 0
    filled: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    held: list[np.ndarray] = field(default_factory=list)
    held_start: int = 0
    held_count: int = 0

    @property
    def held_end(self) -> int:
        return self.held_start + self.held_count

    def mark_filled(self, positions: np.ndarray, end: int) -> None:
        if self.filled.size < end:
            grown = np.zeros(max(end, 2 * self.filled.size), dtype=bool)
            grown[: self.filled.size] = self.filled
            self.filled = grown
        self.filled[positions] = True

    def grow(self, end: int) -> None:
        """Extend the dataset to exactly `end` rows; a column with allocated chunks learns the
        offsets of the chunks that HDF5 allocated for them (only those: they take space in the
        file). Never past `end`: shrinking a dataset when the trace is finished made HDF5 read and
        rewrite the last chunk of every dataset (300 MB for 300 datasets of 4 KB rows on the VM)."""
        if end <= self.extent:
            return
        self.extent = end
        self.ds.id.set_extent((end, *self.row_shape))
        if self.io is None:
            return
        zeros = (0,) * len(self.row_shape)
        for first in range(len(self.offsets) * self.chunk_rows, end, self.chunk_rows):
            self.offsets.append(self.ds.id.get_chunk_info_by_coord((first, *zeros)).byte_offset)

    def write_run(self, start: int, data: np.ndarray) -> None:
        """Write consecutive rows from `start`: into the allocated chunks with one write per
        stretch of adjacent chunks, or through h5py's low-level calls (its slicing front end costs
        a few hundred microseconds a call, which the writer thread holds the GIL for)."""
        data = np.ascontiguousarray(data)
        if self.io is not None:
            self._write_into_chunks(start, data)
            return
        file_space = self.ds.id.get_space()
        file_space.select_hyperslab((start,) + (0,) * len(self.row_shape), data.shape)
        self.ds.id.write(h5py.h5s.create_simple(data.shape), file_space, data)

    def _write_into_chunks(self, start: int, data: np.ndarray) -> None:
        row_bytes = data.nbytes // data.shape[0]
        view = memoryview(data.reshape(-1).view(np.uint8))
        end, c = start + data.shape[0], self.chunk_rows
        piece_at, piece_from, piece_to = -1, 0, 0       # file offset and the bytes of data it takes
        for chunk in range(start // c, (end - 1) // c + 1):
            first, last = max(start, chunk * c), min(end, (chunk + 1) * c)
            at = self.offsets[chunk] + (first - chunk * c) * row_bytes
            lo, hi = (first - start) * row_bytes, (last - start) * row_bytes
            if piece_at >= 0 and at == piece_at + (piece_to - piece_from):
                piece_to = hi
                continue
            if piece_at >= 0:
                self.io.pwrite(view[piece_from:piece_to], piece_at)
            piece_at, piece_from, piece_to = at, lo, hi
        self.io.pwrite(view[piece_from:piece_to], piece_at)

    def hold(self, start: int, data: np.ndarray) -> None:
        if not self.held:
            self.held_start = start
        self.held.append(data)
        self.held_count += data.shape[0]

    def write_held(self) -> None:
        if not self.held:
            return
        self.grow(self.held_end)
        held = self.held
        if self.io is not None and len(held) > 1 and held[-1].shape[0] > self.chunk_rows:   # a large piece: not copied
            self.write_run(self.held_start, np.concatenate(held[:-1]) if len(held) > 2 else held[0])
            self.write_run(self.held_end - held[-1].shape[0], held[-1])
        else:
            self.write_run(self.held_start, held[0] if len(held) == 1 else np.concatenate(held))
        self.held, self.held_count = [], 0


class LatchingFile:
    """An unbuffered file that keeps its first write error and from then on drops writes."""

    def __init__(self, path: Path):
        self._raw = open(path, "w+b", buffering=0)
        self.error: OSError | None = None

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def read(self, size: int) -> bytes:
        data = self._raw.read(size)
        return data + bytes(size - len(data))          # past the end reads as zeros, as in HDF5's own driver

    def _latched(self, call: Callable[[], int], unwritten: int) -> int:
        """`call()`, a write, unless an earlier one failed; its OSError is kept, and `unwritten`
        returned then, as it is from then on."""
        if self.error is None:
            try:
                return call()
            except OSError as exc:
                self.error = exc
        return unwritten

    def write(self, data) -> int:
        return self._latched(lambda: self._raw.write(data), len(data))

    def pwrite(self, view: memoryview, offset: int) -> None:
        """Write `view` at `offset` without moving the file position (rows into allocated chunks),
        at most `_WRITE_BYTES` a system call: on the 2-core VM of docs/benchmarks.md, the 1.65 GB
        of a 2,000-token prefill took 1.4-4.1 s to write in pieces of 4 MB or more and 0.6 s in
        pieces of 1 MB (the cause was not found)."""
        end, fd = offset + len(view), self._raw.fileno()
        while offset < end and self.error is None:
            written = self._latched(lambda: os.pwrite(fd, view[: min(len(view), _WRITE_BYTES)], offset), 0)
            if not written and self.error is None:
                self.error = OSError(errno.EIO, "the file took no bytes")
            view, offset = view[written:], offset + written

    def truncate(self, size: int) -> int:
        return self._latched(lambda: self._raw.truncate(size), size)

    def flush(self) -> None:
        """Writes are unbuffered: nothing to do."""

    def close(self) -> None:
        self._raw.close()

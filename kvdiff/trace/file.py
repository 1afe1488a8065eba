"""TraceFile: every h5py call of one trace being written, for TraceWriter.

h5py must not be used on one file from two threads at once; TraceWriter opens a TraceFile
before its writer thread starts, lets only that thread call it, and finishes or discards it
after the thread has ended.

HDF5 writes through a LatchingFile and rows go into datasets through TraceColumns
(trace_column.py): how rows are held until a chunk is full, written into chunks HDF5 allocated,
and how a write error is kept from HDF5.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Mapping

import h5py
import numpy as np

from kvdiff.trace.digest import ROW_HASH
from kvdiff.trace.hdf5 import set_attributes, stored_text, utf8_strings, write_array
from kvdiff.trace.points import READ_POINTS
from kvdiff.trace.ranges import format_ranges
from kvdiff.trace.sink import ProbeIntegrityError
from kvdiff.trace.column import LatchingFile, TraceColumn
from kvdiff.trace.format import (
    DIGEST_GROUP, DIGEST_LAYOUT, DIGEST_SCHEMA_VERSION, DTYPE_ATTR, FORMAT_NAME, KEY_ROWS_SCHEMA_VERSION,
    KV_ONLY_SCHEMA_VERSION, SCHEMA_VERSION, TraceMeta,
)

_CHUNK_BYTES = 1 << 20            # target HDF5 chunk size
_MIN_CHUNK_BYTES = 8 << 10        # and the least one: rows of a few bytes (norm statistics) get more than 128 a chunk

Steps = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]   # (n, 3) step, position, token; top-k ids, values (n, k); margins
Source = tuple[np.ndarray, str, int, np.ndarray, bool]      # positions, chunk, prefill id, encoded positions, reused


class TraceFile:
    """An open, incomplete trace at `tmp_path`: rows go in by global position; `finish` completes it."""

    def __init__(self, tmp_path: Path, meta: TraceMeta, compression: str | None,
                 max_positions: int | None = None, window_positions: int | None = None):
        """Open the OS file at `tmp_path` (its errors are raised here); `create` makes the HDF5
        file in it. `meta` is the run's: what is known before the run is written by `create`, what
        the run sets (the text, chunks, generated and K/V-only tokens) by `finish`."""
        self.tmp_path = tmp_path
        self.meta = meta
        self.compression = compression
        self.max_positions = max_positions
        self.window_positions = window_positions      # a digest trace's zoom window: its full rows' most positions
        self._io = LatchingFile(tmp_path)
        self._file: h5py.File | None = None
        self._columns: dict[str, TraceColumn] = {}
        self._groups: dict[str, h5py.Group] = {}
        self._layouts: dict[tuple[tuple[int, ...], bool], h5py.h5p.PropDCID] = {}

    def create(self) -> None:
        """Make the HDF5 file, incomplete, with the prompt and the metadata known before the run
        (TraceWriter's first job: a trace's few dozen attributes cost milliseconds, which the
        writer thread spends beside the run rather than at its end)."""
        self._file = h5py.File(self._io, "w", rdcc_nbytes=0)      # no chunk cache: see trace_column.py
        digest = self.meta.trace_mode == "digest"
        set_attributes(self._file, {"format": FORMAT_NAME, "schema_version": DIGEST_SCHEMA_VERSION if digest
                                    else SCHEMA_VERSION, "complete": False})
        write_array(self._file, "input_ids", np.asarray(self.meta.input_ids, dtype=np.int64))
        set_attributes(self._file, _attributes_before_run(self.meta))
        if digest:
            set_attributes(self._file.create_group(DIGEST_GROUP), {"row_hash": ROW_HASH, "layout": DIGEST_LAYOUT})
        self._check_io()

    def _check_io(self) -> None:
        """Raise the OS error a write of the file met, if any."""
        if self._io.error is not None:
            raise self._io.error

    def _column(self, name: str, row_shape: tuple[int, ...], dtype: np.dtype, torch_dtype: str,
                first_rows: tuple[int, bool]) -> TraceColumn:
        """The column `name`, made on its first rows: `first_rows` is their first position and
        whether they are consecutive."""
        col = self._columns.get(name)
        if col is not None:
            if col.row_shape != row_shape or col.dtype != dtype:
                raise ProbeIntegrityError(
                    f"{name}: rows of shape {row_shape} {dtype} after rows of {col.row_shape} {col.dtype}")
            return col
        row_bytes = max(1, int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize)
        most_rows = max(128, _MIN_CHUNK_BYTES // row_bytes // 128 * 128)     # a multiple of 128, as the diff reads
        # a window's positions start anywhere: chunks of an eighth of it waste little at its two ends
        window = max(8, self.window_positions // 8) if self.window_positions and \
            not name.startswith(DIGEST_GROUP + "/") else None
        chunk_rows = int(min(most_rows, max(1, _CHUNK_BYTES // row_bytes), window or self.max_positions or most_rows))
        first, consecutive = first_rows
        # rows from the first chunk on, with nothing between them: the chunks are allocated as the
        # column grows, and all of them will hold rows
        allocated_chunks = (self.compression is None and consecutive and first < chunk_rows
                            and dtype.isnative and dtype.kind in "biuf")
        ds = self._new_column(name, row_shape, dtype, chunk_rows, allocated_chunks)
        if not name.startswith(DIGEST_GROUP + "/"):       # digests are stored as they were computed
            set_attributes(ds, {DTYPE_ATTR: torch_dtype})
        col = self._columns[name] = TraceColumn(ds, row_shape, dtype, chunk_rows, self._io if allocated_chunks else None)
        return col

    def _new_column(self, name: str, row_shape: tuple[int, ...], dtype: np.dtype, chunk_rows: int,
                    allocated_chunks: bool) -> h5py.Dataset:
        """An empty, extendable dataset made with h5py's low-level calls, as `create_dataset` would
        make it: a trace has hundreds of datasets, and `create_dataset` costs about a millisecond
        each in Python. With `allocated_chunks`, HDF5 allocates chunks when the extent grows and
        writes no fill values into them (TraceColumn writes the rows)."""
        parent, _, leaf = name.rpartition("/")
        group = self._groups.get(parent)
        if group is None:
            group = self._groups[parent] = self._file.require_group(parent) if parent else self._file
        chunks = (chunk_rows, *row_shape)
        dcpl = self._layouts.get((chunks, allocated_chunks))
        if dcpl is None:
            dcpl = self._layouts[chunks, allocated_chunks] = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            dcpl.set_chunk(chunks)
            dcpl.set_obj_track_times(False)       # as h5py does: no time stamps, the same bytes every run
            if allocated_chunks:
                dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
                dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
            if self.compression == "gzip":
                dcpl.set_deflate(4)                 # h5py's default level
            elif self.compression == "lzf":
                dcpl.set_filter(h5py.h5z.FILTER_LZF, h5py.h5z.FLAG_OPTIONAL)
        space = h5py.h5s.create_simple((0, *row_shape), (h5py.h5s.UNLIMITED, *row_shape))
        return h5py.Dataset(h5py.h5d.create(group.id, leaf.encode(), h5py.h5t.py_create(dtype, logical=True), space,
                                           dcpl=dcpl))

    def put(self, name: str, positions: np.ndarray, data: np.ndarray, torch_dtype: str) -> None:
        """Rows `data` at row index = global position; a later row for a position replaces an earlier one."""
        if positions.size == 0:
            return
        if positions.size > 1 and not bool(np.all(positions[1:] > positions[:-1])):
            order = np.argsort(positions, kind="stable")
            positions, data = positions[order], data[order]
        first, end = int(positions[0]), int(positions[-1]) + 1
        col = self._column(name, data.shape[1:], data.dtype, torch_dtype, (first, end - first == positions.size))
        col.mark_filled(positions, end)
        if end - first != positions.size:
            col.write_held()
            col.grow(end)
            col.ds[positions] = data
        else:
            if col.held and col.held_end != first:
                col.write_held()
            start = col.held_start if col.held else first
            if end // col.chunk_rows > start // col.chunk_rows:     # the run reaches the end of a chunk
                col.hold(first, data)
                col.write_held()
            else:
                col.hold(first, data.copy())      # kept past this call: the caller's buffer may be reused
        self._check_io()

    def _write_all_held(self) -> None:
        for col in self._columns.values():
            col.write_held()
        self._check_io()

    def put_weight(self, name: str, weight: np.ndarray, dtype: str, **attrs: float) -> None:
        """A model weight at `name` (format.norm_weight_path, latent_weight_path), its own dtype and `attrs`."""
        ds = self._file.create_dataset(name, data=weight)      # its parent groups made as needed
        set_attributes(ds, {**attrs, DTYPE_ATTR: dtype})
        self._check_io()

    def flush(self) -> None:
        self._write_all_held()
        self._file.flush()
        self._check_io()

    def _split_columns(self) -> tuple[dict[str, TraceColumn], dict[str, TraceColumn]]:
        """(row columns, digest columns)."""
        rows = {n: c for n, c in self._columns.items() if not n.startswith(DIGEST_GROUP + "/")}
        return rows, {n: c for n, c in self._columns.items() if n not in rows}

    @staticmethod
    def _recorded_positions(columns: Mapping[str, TraceColumn]) -> np.ndarray:
        """Sorted global positions that any of `columns` holds."""
        if not columns:
            return np.zeros(0, dtype=np.int64)
        size = max(c.filled.size for c in columns.values())
        union = np.zeros(size, dtype=bool)
        for col in columns.values():
            union[: col.filled.size] |= col.filled
        return np.flatnonzero(union).astype(np.int64)

    @staticmethod
    def _check_complete(columns: Mapping[str, TraceColumn], positions: np.ndarray, partial: np.ndarray) -> None:
        """Every column holds every recorded position; only k and v the `partial` ones (K/V-, key-only)."""
        computed = np.setdiff1d(positions, partial, assume_unique=True)
        for name, col in columns.items():
            digest = name.startswith(DIGEST_GROUP + "/")
            parts = name.removeprefix(DIGEST_GROUP + "/").split("/")
            # K/V-only positions hold k and v rows, and rows of their digest table
            kv = parts[0] == "layers" and (parts[-1].startswith("kv_") if digest else parts[-1] in READ_POINTS)
            wanted = positions if kv else computed
            held = np.flatnonzero(col.filled)
            if not np.array_equal(held, wanted):
                missing = np.setdiff1d(wanted, held)
                if missing.size:
                    raise ProbeIntegrityError(
                        f"{name} holds no rows for positions {format_ranges(missing)}: the probe did not fire there")
                extra = np.setdiff1d(held, wanted)
                raise ProbeIntegrityError(f"{name} holds rows for positions {format_ranges(extra)}, where only k "
                                          "and v are recorded (K/V read from the cache, or a window's keys)")

    def _write_tables(self, positions: np.ndarray, steps: list[Steps], provenance: list[Source]) -> None:
        f = self._file
        write_array(f, "positions", positions)
        write_array(f, "generated_ids", np.asarray(self.meta.generated_ids, dtype=np.int64))
        table, ids, values, margins = (np.concatenate([s[i] for s in steps]) for i in range(4)) if steps else (
            np.zeros((0, 3), np.int64), np.zeros((0, 0), np.int64), np.zeros((0, 0), np.float32), np.zeros(0))
        g = f.create_group("steps")
        write_array(g, "step", table[:, 0])
        write_array(g, "position", table[:, 1])
        write_array(g, "token_id", table[:, 2])
        write_array(g, "topk_ids", ids)
        write_array(g, "topk_values", values)
        write_array(g, "margin", margins)
        if provenance:
            prov = f.create_group("provenance")
            reports = np.repeat(np.arange(len(provenance)), [s[0].size for s in provenance])
            reported = np.concatenate([s[0] for s in provenance])
            # a later report for a position replaces an earlier one: the last row of each position
            keys, from_end = np.unique(reported[::-1], return_index=True)
            rows = reported.size - 1 - from_end
            write_array(prov, "positions", keys)
            write_array(prov, "chunk", utf8_strings([s[1] for s in provenance])[reports[rows]])
            write_array(prov, "prefill_id", np.array([s[2] for s in provenance], dtype=np.int64)[reports[rows]])
            write_array(prov, "encoded_position", np.concatenate([s[3] for s in provenance])[rows])
            write_array(prov, "reused", np.array([s[4] for s in provenance], dtype=bool)[reports[rows]])

    def finish(self, steps: list[Steps], provenance: list[Source]) -> int:
        """Check every dataset holds every recorded position, write the tables and the metadata the
        run set, set `complete` last and close the file. Returns the number of recorded positions."""
        meta = self.meta
        self._write_all_held()
        row_columns, digest_columns = self._split_columns()
        positions = self._recorded_positions(row_columns)
        digested = self._recorded_positions(digest_columns)
        kv_only = np.unique(np.asarray(meta.kv_only_positions, dtype=np.int64))
        unrecorded = np.setdiff1d(kv_only, np.union1d(positions, digested), assume_unique=True)
        if unrecorded.size:
            raise ProbeIntegrityError(f"K/V-only positions {format_ranges(unrecorded)} hold no k or v rows")
        key_only = np.setdiff1d(np.asarray(meta.key_only_positions, dtype=np.int64), kv_only)
        if np.setdiff1d(key_only, positions, assume_unique=True).size:
            raise ProbeIntegrityError(f"key-only positions {format_ranges(key_only)} hold no k or v rows")
        # so every dataset's extent ends at the last position
        partial = np.union1d(np.intersect1d(kv_only, positions, assume_unique=True), key_only)
        self._check_complete(row_columns, positions, partial)
        self._check_complete(digest_columns, digested, kv_only)
        self._write_tables(positions, steps, provenance)
        closing = _attributes_after_run(meta)
        if kv_only.size:
            write_array(self._file, "kv_only_positions", kv_only)
            if meta.trace_mode != "digest":
                closing["schema_version"] = KV_ONLY_SCHEMA_VERSION
        if key_only.size:
            write_array(self._file, "key_only_positions", key_only)
            closing["schema_version"] = KEY_ROWS_SCHEMA_VERSION
        if meta.trace_mode == "digest":
            write_array(self._file[DIGEST_GROUP], "positions", digested)
        set_attributes(self._file, {**closing, "complete": True})
        self._file.close()
        self._io.close()
        self._check_io()
        return int(positions.size)

    def discard(self) -> None:
        """Close the file if open and delete it."""
        self._columns.clear()
        try:
            if self._file is not None and self._file.id.valid:
                self._file.close()
        finally:
            self._io.close()
            self.tmp_path.unlink(missing_ok=True)


def _attributes_before_run(meta: TraceMeta) -> dict:
    """The root's attributes known before the run: the model, dims, messages and what is recorded."""
    attrs = {name: stored_text(getattr(meta, name)) for name in TraceMeta.SCALARS if name not in TraceMeta.SET_BY_RUN}
    attrs.update(asdict(meta.dims))
    windows = attrs.pop("layer_windows")
    if windows:
        attrs["layer_windows"] = np.asarray(windows, dtype=np.int64)
    attrs.update(messages_json=json.dumps(meta.messages), points=json.dumps(list(meta.points)),
                 layers=np.asarray(meta.layers, dtype=np.int64))
    if meta.trace_mode == "digest":
        attrs.update(trace_mode=meta.trace_mode, digest_points=json.dumps(list(meta.digest_points)),
                     digest_layers=np.asarray(meta.digest_layers, dtype=np.int64))
    return attrs


def _attributes_after_run(meta: TraceMeta) -> dict:
    """The root's attributes the run sets: its text and chunks."""
    attrs = {name: stored_text(getattr(meta, name)) for name in TraceMeta.SET_BY_RUN}
    return {**attrs, "chunks_json": json.dumps([c.to_json() for c in meta.chunks])}

"""TraceWriter: appends captured rows to an HDF5 trace as generation proceeds.

The file is written under a temporary name in the target's folder; `close()` checks that every
recorded point holds every recorded position, sets the `complete` attribute last, and renames
the file into place. A writer that dies before that leaves only the temporary file, which
readers refuse as incomplete.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Sequence

import h5py
import numpy as np
import torch

from kvdiff.errors import TraceError
from kvdiff.probes.selection import format_ranges
from kvdiff.probes.sink import ProbeIntegrityError
from kvdiff.probes.trace_format import (
    DTYPE_ATTR, FORMAT_NAME, SCHEMA_VERSION, ChunkRecord, TraceMeta, norm_weight_path, to_storage,
)

log = logging.getLogger(__name__)

_CHUNK_BYTES = 1 << 20            # target HDF5 chunk size
_COMPRESSIONS = (None, "gzip", "lzf")


class TraceWriter:
    """Writes one trace. Use as a context manager, or call `close()` / `abort()` yourself."""

    def __init__(self, path: str | os.PathLike, meta: TraceMeta, compression: str | None = None):
        if compression not in _COMPRESSIONS:
            raise TraceError(f"unknown compression {compression!r}: use none, gzip or lzf")
        self.path = Path(path)
        if not self.path.parent.is_dir():
            raise TraceError(f"cannot write trace {self.path}: folder {self.path.parent} does not exist")
        self.meta = meta
        self.compression = compression
        self.tmp_path = self.path.parent / f".{self.path.name}.{os.getpid()}.partial"
        # No chunk cache: rows go straight to the file, so a failed write (disk full) raises at once;
        # HDF5 crashes the process when it cannot flush cached chunks at close.
        self._file = h5py.File(self.tmp_path, "w", rdcc_nbytes=0)
        self._filled: dict[str, np.ndarray] = {}     # dataset path -> bool mask over positions
        self._provenance: dict[int, tuple[str, int, int, bool]] = {}
        self._steps: list[tuple] = []
        self._file.attrs["format"] = FORMAT_NAME
        self._file.attrs["schema_version"] = SCHEMA_VERSION
        self._file.attrs["complete"] = False
        self._file.create_dataset("input_ids", data=np.asarray(meta.input_ids, dtype=np.int64))

    # -- rows --------------------------------------------------------------------------------

    def _dataset(self, name: str, row_shape: tuple[int, ...], dtype: np.dtype, torch_dtype: str) -> h5py.Dataset:
        if name in self._file:
            ds = self._file[name]
            if ds.shape[1:] != row_shape or ds.dtype != dtype:
                raise ProbeIntegrityError(
                    f"{name}: rows of shape {row_shape} {dtype} after rows of {ds.shape[1:]} {ds.dtype}")
            return ds
        row_bytes = max(1, int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize)
        chunk_rows = int(min(128, max(1, _CHUNK_BYTES // row_bytes)))
        ds = self._file.create_dataset(
            name, shape=(0, *row_shape), maxshape=(None, *row_shape), dtype=dtype,
            chunks=(chunk_rows, *row_shape), compression=self.compression)
        ds.attrs[DTYPE_ATTR] = torch_dtype
        self._filled[name] = np.zeros(0, dtype=bool)
        return ds

    def _put(self, name: str, positions: np.ndarray, data: np.ndarray, torch_dtype: str) -> None:
        """Write `data` rows at row index = global position, growing the dataset as needed."""
        if data.shape[0] != positions.shape[0]:
            raise ProbeIntegrityError(f"{name}: {data.shape[0]} rows for {positions.shape[0]} positions")
        if positions.size == 0:
            return
        ds = self._dataset(name, data.shape[1:], data.dtype, torch_dtype)
        if positions.size > 1 and not bool(np.all(positions[1:] > positions[:-1])):
            order = np.argsort(positions, kind="stable")
            positions, data = positions[order], data[order]
        end = int(positions[-1]) + 1
        if end > ds.shape[0]:
            ds.resize(max(end, 2 * ds.shape[0]), axis=0)
        if end - int(positions[0]) == positions.size:
            ds[int(positions[0]):end] = data
        else:
            ds[positions] = data
        filled = self._filled[name]
        if filled.size < end:
            filled = np.concatenate((filled, np.zeros(max(end, 2 * filled.size) - filled.size, dtype=bool)))
        filled[positions] = True
        self._filled[name] = filled

    def write_rows(self, group: str, point: str, positions: Sequence[int], rows: torch.Tensor) -> None:
        """Rows (T, ...) of `point` in `group` ('layers/<i>' or 'final') at global `positions`."""
        data, torch_dtype = to_storage(rows)
        self._put(f"{group}/{point}", np.asarray(positions, dtype=np.int64), data, torch_dtype)

    def write_norm_stats(self, group: str, norm: str, positions: Sequence[int], stats: dict[str, np.ndarray]) -> None:
        """Per-token float64 statistics of norm module `norm` in `group`."""
        pos = np.asarray(positions, dtype=np.int64)
        for stat, values in stats.items():
            self._put(f"{group}/norm_stats/{norm}/{stat}", pos, np.asarray(values, dtype=np.float64), "float64")

    def write_norm_weight(self, layer: int | None, norm: str, weight: torch.Tensor, eps: float) -> None:
        """A norm's weight (float32, or float64 for a float64 model) and epsilon."""
        w = weight.detach().to("cpu", torch.float64 if weight.dtype == torch.float64 else torch.float32)
        ds = self._file.create_dataset(norm_weight_path(layer, norm), data=w.numpy())
        ds.attrs["eps"] = float(eps)
        ds.attrs[DTYPE_ATTR] = str(weight.dtype).removeprefix("torch.")

    # -- steps and provenance ----------------------------------------------------------------

    def append_step(self, step: int, position: int, token_id: int, topk_ids: np.ndarray,
                    topk_values: np.ndarray, margin: float) -> None:
        """One generated step (kept in memory: a few bytes a step; written at close)."""
        self._steps.append((step, position, token_id, np.asarray(topk_ids, np.int64),
                            np.asarray(topk_values, np.float32), float(margin)))

    def write_provenance(self, positions: Sequence[int], chunk: str, prefill_id: int,
                         encoded_positions: Sequence[int], reused: bool) -> None:
        """Where the K/V at `positions` came from; a later report for a position replaces an earlier one."""
        if len(encoded_positions) != len(positions):
            raise ProbeIntegrityError(
                f"provenance of chunk {chunk!r}: {len(encoded_positions)} encoded positions for {len(positions)} positions")
        for p, e in zip(positions, encoded_positions):
            self._provenance[int(p)] = (chunk, int(prefill_id), int(e), bool(reused))

    # -- closing -----------------------------------------------------------------------------

    def recorded_positions(self) -> np.ndarray:
        """Sorted global positions that any dataset holds so far."""
        if not self._filled:
            return np.zeros(0, dtype=np.int64)
        size = max(f.size for f in self._filled.values())
        union = np.zeros(size, dtype=bool)
        for filled in self._filled.values():
            union[: filled.size] |= filled
        return np.flatnonzero(union).astype(np.int64)

    def _check_complete(self, positions: np.ndarray) -> None:
        for name, filled in self._filled.items():
            held = np.flatnonzero(filled)
            if held.size != positions.size:
                missing = np.setdiff1d(positions, held)
                raise ProbeIntegrityError(
                    f"{name} holds no rows for positions {format_ranges(missing)}: the probe did not fire there")

    def _write_tables(self, positions: np.ndarray) -> None:
        f = self._file
        f.create_dataset("positions", data=positions)
        f.create_dataset("generated_ids", data=np.asarray(self.meta.generated_ids, dtype=np.int64))
        k = max((s[3].size for s in self._steps), default=0)
        steps = f.create_group("steps")
        steps.create_dataset("step", data=np.array([s[0] for s in self._steps], dtype=np.int64))
        steps.create_dataset("position", data=np.array([s[1] for s in self._steps], dtype=np.int64))
        steps.create_dataset("token_id", data=np.array([s[2] for s in self._steps], dtype=np.int64))
        steps.create_dataset("topk_ids", data=np.array([s[3] for s in self._steps], dtype=np.int64).reshape(len(self._steps), k))
        steps.create_dataset("topk_values", data=np.array([s[4] for s in self._steps], dtype=np.float32).reshape(len(self._steps), k))
        steps.create_dataset("margin", data=np.array([s[5] for s in self._steps], dtype=np.float64))
        if self._provenance:
            prov = f.create_group("provenance")
            keys = sorted(self._provenance)
            rows = [self._provenance[p] for p in keys]
            prov.create_dataset("positions", data=np.array(keys, dtype=np.int64))
            prov.create_dataset("chunk", data=[r[0] for r in rows], dtype=h5py.string_dtype())
            prov.create_dataset("prefill_id", data=np.array([r[1] for r in rows], dtype=np.int64))
            prov.create_dataset("encoded_position", data=np.array([r[2] for r in rows], dtype=np.int64))
            prov.create_dataset("reused", data=np.array([r[3] for r in rows], dtype=bool))

    def _write_meta(self) -> None:
        attrs = self._file.attrs
        for name in TraceMeta.SCALARS:
            value = getattr(self.meta, name)
            # HDF5 strings cannot hold NUL (a model may generate one): it is stored as U+2400.
            attrs[name] = value if isinstance(value, (int, float)) else str(value).replace("\0", "\u2400")
        attrs["messages_json"] = json.dumps(self.meta.messages)
        attrs["chunks_json"] = json.dumps([c.to_json() for c in self.meta.chunks])
        attrs["points"] = json.dumps(list(self.meta.points))
        attrs["layers"] = np.asarray(self.meta.layers, dtype=np.int64)

    def close(self, generated_ids: Sequence[int] | None = None, text: str | None = None,
              chunks: Sequence[ChunkRecord] | None = None) -> Path:
        """Finish the trace (optionally setting the generation's outcome) and rename it into place."""
        if generated_ids is not None:
            self.meta.generated_ids = np.asarray(generated_ids, dtype=np.int64)
        if text is not None:
            self.meta.text = text
        if chunks is not None:
            self.meta.chunks = list(chunks)
        try:
            positions = self.recorded_positions()
            self._check_complete(positions)
            for name, filled in self._filled.items():
                self._file[name].resize(int(positions[-1]) + 1 if positions.size else 0, axis=0)
            self._write_tables(positions)
            self._write_meta()
            self._file.attrs["complete"] = True
            self._file.close()
        except BaseException:
            self.abort()
            raise
        os.replace(self.tmp_path, self.path)
        log.info("trace written: %s (%d positions, %.1f MB)", self.path, positions.size,
                 self.path.stat().st_size / 1e6)
        return self.path

    def abort(self) -> None:
        """Drop the unfinished trace: close and delete the temporary file."""
        if self._file.id.valid:
            try:
                self._file.close()
            except (OSError, RuntimeError):  # the failure that led here (disk full) fails the close too
                log.debug("closing unfinished trace %s failed", self.tmp_path, exc_info=True)
        self.tmp_path.unlink(missing_ok=True)

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self._file.id.valid:
            self.close()

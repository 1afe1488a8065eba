"""TraceReader: lazy, validated access to a finished HDF5 trace.

Opening checks the file is a complete kvdiff trace of a schema this kvdiff reads; each layer's
arrays are read only when asked for, so a large trace never loads whole.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import h5py
import numpy as np

from kvdiff.errors import TraceError
from kvdiff.trace.checks import as_int, check_layout, check_self_contained, read_attr, read_meta, read_positions
from kvdiff.trace.format import (
    DTYPE_ATTR, FORMAT_NAME, KEY_ROWS_SCHEMA_VERSION, ProvenanceRecords, StepRecords, digest_path, digest_table_of,
    digest_tables, from_storage, latent_weight_path, norm_weight_path, point_group, router_bias_path,
)
from kvdiff.trace.digest_checks import check_digests
from kvdiff.trace.weight_checks import check_weights
from kvdiff.trace.paths import check_trace_path


Rows = slice | np.ndarray | None       # which of a trace's positions to read: a slice or indices into them


@dataclass(frozen=True)
class DatasetInfo:
    """One dataset of a trace, for `kvdiff inspect`."""

    name: str
    shape: tuple[int, ...]
    dtype: str            # the captured dtype (bfloat16 for uint16-coded rows)
    stored_bytes: int     # bytes on disk (after compression)


def _stored_dtype(ds: h5py.Dataset) -> str:
    """The torch dtype a dataset's rows had when captured."""
    return str(ds.attrs.get(DTYPE_ATTR, ds.dtype))


def _open_file(path: Path) -> h5py.File:
    check_trace_path(path)
    if not h5py.is_hdf5(path):
        raise TraceError(f"{path} is not an HDF5 file, so not a kvdiff trace")
    try:
        return h5py.File(path, "r", rdcc_nbytes=0)      # no chunk cache: open datasets would each keep MBs
    except OSError as exc:
        why = "truncated" if "truncated" in str(exc) else "corrupt"
        raise TraceError(f"trace {path} is {why}: HDF5 cannot open it; record it again") from None


def _validate(path: Path, f: h5py.File) -> None:
    name = read_attr(path, f, "format", None)
    if not isinstance(name, str) or name != FORMAT_NAME:
        raise TraceError(f"{path} is an HDF5 file but not a kvdiff trace (no format={FORMAT_NAME!r})")
    version = as_int(path, "schema_version", read_attr(path, f, "schema_version"), low=1, high=2 ** 64)
    if version > KEY_ROWS_SCHEMA_VERSION:
        raise TraceError(f"trace {path} has schema {version}, newer than this kvdiff reads "
                         f"(1 to {KEY_ROWS_SCHEMA_VERSION}): upgrade kvdiff")
    complete = read_attr(path, f, "complete", False)
    if not (isinstance(complete, np.bool_) and complete):
        raise TraceError(f"trace {path} is incomplete: its writer did not finish (killed or failed); record it again")


class TraceReader:
    """A finished trace. Open with `open_trace(path)`; arrays are aligned with `positions`.

    Reads are lazy and as narrow as asked: one layer, one point, or a block of rows of it.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._file = _open_file(self.path)
        try:
            _validate(self.path, self._file)
            check_self_contained(self.path, self._file)     # before any dataset is read
            self.meta = read_meta(self.path, self._file)
            self.positions: np.ndarray = read_positions(self.path, self._file)
            check_layout(self.path, self._file, self.meta, self.positions)
            check_weights(self.path, self._file, self.meta.dims)
            # digest traces: the positions holding digests (a full trace: none)
            self.digest_positions: np.ndarray = check_digests(self.path, self._file, self.meta, self.positions)
            self._datasets: dict[tuple[int | None, str], tuple[h5py.Dataset, str]] = {}
            self._digest_tables: dict[str, np.ndarray] = {}
        except (KeyError, OSError, RuntimeError) as exc:     # HDF5 cannot read the file's structure
            self._file.close()
            raise TraceError(f"trace {self.path} is damaged ({exc}); record it again") from None
        except TraceError:
            self._file.close()
            raise

    def _read(self, ds: h5py.Dataset, index=()) -> np.ndarray:
        """`ds[index]`; data HDF5 cannot read (a damaged file) is a TraceError."""
        try:
            return ds[index]
        except (OSError, RuntimeError) as exc:
            raise TraceError(f"trace {self.path} is damaged: HDF5 cannot read {ds.name} ({exc}); "
                             f"record it again") from None

    def _rows(self, ds: h5py.Dataset, dtype: str, rows: Rows = None) -> np.ndarray:
        """The dataset's rows at `positions[rows]` (row index = global position); every position by default.

        The span from the first to the last wanted position is read, or only the wanted rows
        when they fill less than half of it."""
        pos = self.positions if rows is None else self.positions[rows]
        if pos.size == 0:
            return from_storage(np.zeros((0, *ds.shape[1:]), dtype=ds.dtype), dtype)
        lo, hi = int(pos.min()), int(pos.max()) + 1
        increasing = bool(np.all(pos[1:] > pos[:-1]))
        if increasing and hi - lo == pos.size:
            data = self._read(ds, slice(lo, hi))
        elif increasing and hi - lo > 2 * pos.size:
            data = self._read(ds, pos)     # sparse: read only the wanted rows
        else:
            data = self._read(ds, slice(lo, hi))[pos - lo]
        return from_storage(data, dtype)

    def _group(self, layer: int | None) -> h5py.Group:
        group = point_group(layer if layer is None else int(layer))
        if group not in self._file:
            raise TraceError(f"trace {self.path} holds no {group!r}: recorded layers are {list(self.meta.layers)}")
        return self._file[group]

    def _dataset(self, layer: int | None, point: str) -> tuple[h5py.Dataset, str]:
        """A point's dataset and captured dtype, looked up once (h5py lookups cost more than small reads)."""
        key = (layer if layer is None else int(layer), point)
        if key not in self._datasets:
            ds = self._group(layer).get(point)
            if not isinstance(ds, h5py.Dataset):
                raise TraceError(f"trace {self.path} holds no probe point {point!r} in {point_group(key[0])!r}")
            self._datasets[key] = (ds, _stored_dtype(ds))
        return self._datasets[key]

    def points_in(self, layer: int | None) -> list[str]:
        """The probe points recorded in `layer` (None: the final points), without reading them."""
        g = self._group(layer)
        return [name for name in g if isinstance(g[name], h5py.Dataset)]

    def point(self, layer: int | None, name: str, rows: Rows = None) -> np.ndarray:
        """(n, ...) rows of probe point `name` of `layer` (None: a final point) at `positions[rows]`:
        `rows` is a slice or an index array into `positions`; every position by default."""
        return self._rows(*self._dataset(layer, name), rows)

    def row_nbytes(self, layer: int | None, name: str) -> int:
        """Bytes of one row of `name` as `point` returns it (bfloat16 rows come back as float32)."""
        ds, dtype = self._dataset(layer, name)
        itemsize = 4 if dtype == "bfloat16" else ds.dtype.itemsize
        return int(np.prod(ds.shape[1:], dtype=np.int64)) * itemsize

    def layer(self, i: int, points: Iterable[str] | None = None, rows: Rows = None) -> dict[str, np.ndarray]:
        """Probe point -> (n, ...) array for layer `i`: the `points` asked for (default all) at
        `positions[rows]` (default all); nothing else is read."""
        return {name: self.point(int(i), name, rows) for name in (self.points_in(i) if points is None else points)}

    def final(self, points: Iterable[str] | None = None, rows: Rows = None) -> dict[str, np.ndarray]:
        """final_norm and logits (those recorded, or the `points` asked for) at `positions[rows]`."""
        return {name: self.point(None, name, rows) for name in (self.points_in(None) if points is None else points)}

    def digests(self, layer: int | None, point: str, rows: Rows = None) -> tuple[np.ndarray, np.ndarray]:
        """(hash int64 (n,), stats float32 (n, 2): rms, max_abs) of `point` of `layer` (None: a
        final point) at `digest_positions[rows]`; every digested position by default."""
        table = digest_table_of(point)
        columns = digest_tables(self.meta.digest_points, layer).get(table, ())
        if point not in columns or (layer is not None and layer not in self.meta.digest_layers):
            raise TraceError(f"trace {self.path} holds no digests of {point!r} in {point_group(layer)!r}")
        pos = self.digest_positions if rows is None else self.digest_positions[rows]
        cell = (columns.index(point),) if layer is None else (self.meta.digest_layers.index(layer), columns.index(point))
        hashes, stats = (self._digest_table(digest_path(layer is None, table, part)) for part in ("hash", "stats"))
        return hashes[(pos, *cell)], stats[(pos, *cell)]

    def _digest_table(self, name: str) -> np.ndarray:
        """A digest dataset's rows to the last digested position, read once (a table holds every
        layer's digests, read a point at a time: a 32k-token trace's are ~100 MB)."""
        table = self._digest_tables.get(name)
        if table is None:
            end = int(self.digest_positions[-1]) + 1 if self.digest_positions.size else 0
            table = self._digest_tables[name] = self._read(self._file[name], slice(0, end))
        return table

    def norm_stats(self, layer: int | None) -> dict[str, dict[str, np.ndarray]]:
        """Norm name -> statistic name -> float64 (n_positions,) for `layer` (None: final norm)."""
        name = f"{point_group(layer)}/norm_stats"
        if name not in self._file:
            return {}
        g = self._file[name]
        return {norm: {stat: self._rows(g[norm][stat], _stored_dtype(g[norm][stat])) for stat in g[norm]} for norm in g}

    def norm_weight(self, layer: int | None, norm: str) -> tuple[np.ndarray, float]:
        """A norm module's weight and epsilon (norm: attn_norm, mlp_norm, final_norm, q_norm, k_norm)."""
        name = norm_weight_path(layer, norm)
        if name not in self._file:
            raise TraceError(f"trace {self.path} holds no weight for norm {norm!r} of layer {layer}")
        ds = self._file[name]
        return self._read(ds), float(ds.attrs["eps"])

    def latent_weight(self, layer: int) -> np.ndarray | None:
        """Multi-head latent attention: `layer`'s kv_b_proj weight per head, (heads, qk_nope_head_dim +
        v_head_dim, latent_dim), which expands a latent into each head's K without RoPE and its V; None
        where the trace holds none (recorded without kv_latent, or by a writer that does not store it)."""
        name = latent_weight_path(layer)
        return self._read(self._file[name]) if name in self._file else None

    def router_bias(self, layer: int) -> np.ndarray | None:
        """DeepSeek's routing: `layer`'s bias added to the sigmoid scores to choose experts (num_experts,);
        None where the trace holds none (a dense layer, or router_logits not recorded)."""
        name = router_bias_path(layer)
        return self._read(self._file[name]) if name in self._file else None

    @property
    def steps(self) -> StepRecords:
        g = self._file["steps"]
        return StepRecords(**{name: self._read(g[name]) for name in
                              ("step", "position", "token_id", "topk_ids", "topk_values", "margin")})

    @property
    def provenance(self) -> ProvenanceRecords | None:
        """Per-position provenance (engine paths), aligned with `positions`, or None when the path
        reported none."""
        return self.provenance_at(self.positions)

    def provenance_at(self, positions: np.ndarray) -> ProvenanceRecords | None:
        """The provenance aligned with `positions` (a digest trace's `digest_positions`, say)."""
        if "provenance" not in self._file:
            return None
        g = self._file["provenance"]
        index = {int(p): i for i, p in enumerate(self._read(g["positions"]))}
        chunk = [name.decode("utf-8", "replace") for name in self._read(g["chunk"])]
        prefill, encoded, reused = self._read(g["prefill_id"]), self._read(g["encoded_position"]), self._read(g["reused"])
        rows = [index.get(int(p)) for p in positions]
        return ProvenanceRecords(
            chunk=[str(chunk[r]) if r is not None else "" for r in rows],
            prefill_id=np.array([prefill[r] if r is not None else -1 for r in rows], dtype=np.int64),
            encoded_position=np.array([encoded[r] if r is not None else -1 for r in rows], dtype=np.int64),
            reused=np.array([bool(reused[r]) if r is not None else False for r in rows], dtype=bool),
        )

    @property
    def nbytes(self) -> int:
        """Size of the trace file on disk."""
        return self.path.stat().st_size

    def datasets(self) -> list[DatasetInfo]:
        """Every dataset with its shape, captured dtype and bytes on disk."""
        out: list[DatasetInfo] = []

        def visit(name: str, obj) -> None:
            if isinstance(obj, h5py.Dataset):
                out.append(DatasetInfo(name, obj.shape, _stored_dtype(obj),
                                       obj.id.get_storage_size()))

        try:
            self._file.visititems(visit)
        except (OSError, RuntimeError, KeyError, TypeError, ValueError) as exc:   # what h5py raises on damage
            raise TraceError(f"trace {self.path} is damaged: HDF5 cannot list its datasets ({exc}); "
                             f"record it again") from None
        return out

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "TraceReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_trace(path: str | os.PathLike) -> TraceReader:
    """Open a finished trace; TraceError with one line if it is missing, foreign, incomplete,
    truncated or of a newer schema."""
    return TraceReader(path)

"""A digest trace's own checks: /digests holds a hash and a statistics dataset per digest table
(format.digest_tables) of the layers, rows of digest_layers x points, and of the final points,
covering /digests/positions, and nothing else."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from kvdiff.trace.checks import _dataset, _member, malformed, read_positions
from kvdiff.errors import TraceError
from kvdiff.trace.digest import DIGEST_STATS, ROW_HASH
from kvdiff.trace.format import DIGEST_GROUP, DIGEST_LAYOUT, FINAL_GROUP, TraceMeta, digest_tables


def _check_group(path: Path, group: h5py.Group, tables: dict[str, tuple[str, ...]], rows: int,
                 layers: tuple[int, ...]) -> None:
    """`group`'s tables: hash int64 (rows, *layers, columns), stats float32 (..., 2); `layers`
    the layer axis's length, () for the final points."""
    names = {f"{table}{part}" for table in tables for part in ("hash", "stats")}
    extra = sorted(set(group) - names)
    if extra:
        raise malformed(path, f"{group.name} holds {extra}: its digests are {sorted(names)}")
    across = " x ".join([*(f"{n} layers" for n in layers), ""])
    for table, points in tables.items():
        row = (*layers, len(points))
        hashes, stats = _dataset(path, group, f"{table}hash"), _dataset(path, group, f"{table}stats")
        if hashes.shape[1:] != row or hashes.dtype != np.int64 or hashes.shape[0] < rows:
            raise malformed(path, f"{hashes.name} must be int64 rows of {across}{len(points)} (a column per point), "
                                  f"{rows} or more, not {hashes.shape} {hashes.dtype}")
        if stats.shape[1:] != (*row, len(DIGEST_STATS)) or stats.dtype != np.float32 or stats.shape[0] < rows:
            raise malformed(path, f"{stats.name} must be float32 rows of {across}{len(points)} x {len(DIGEST_STATS)} "
                                  f"({', '.join(DIGEST_STATS)}), {rows} or more, not {stats.shape} {stats.dtype}")


def check_digests(path: Path, f: h5py.File, meta: TraceMeta, positions: np.ndarray) -> np.ndarray:
    """The digests of a digest trace, checked; returns /digests/positions (empty for a full trace,
    which must hold no /digests)."""
    if meta.trace_mode != "digest":
        if DIGEST_GROUP in f:
            raise malformed(path, f"/{DIGEST_GROUP} in a trace of trace_mode {meta.trace_mode!r}")
        return np.zeros(0, dtype=np.int64)
    root = _member(path, f, DIGEST_GROUP, h5py.Group)
    row_hash = root.attrs.get("row_hash")
    if row_hash != ROW_HASH:
        raise TraceError(f"{path}'s digests were hashed by " + (f"{row_hash!r}" if isinstance(row_hash, str) else
                         "an earlier kvdiff") + f", not by this kvdiff's {ROW_HASH!r}: record it again")
    if root.attrs.get("layout") != DIGEST_LAYOUT:
        raise TraceError(f"{path}'s digests are laid out as an earlier kvdiff wrote them (a dataset per layer), "
                         f"not in this kvdiff's {DIGEST_LAYOUT!r} tables: record it again")
    digested = read_positions(path, root)
    if np.setdiff1d(positions, digested).size or np.setdiff1d(meta.kv_only_positions, digested).size:
        raise malformed(path, "positions or kv_only_positions hold positions that /digests/positions does not")
    rows = int(digested[-1]) + 1 if digested.size else 0
    layer_tables = digest_tables(meta.digest_points, meta.digest_layers[0]) if meta.digest_layers else {}
    final_tables = digest_tables(meta.digest_points, None)
    groups = {"positions", *(["layers"] if layer_tables else []), *([FINAL_GROUP] if final_tables else [])}
    if set(root) != groups:
        raise malformed(path, f"/{DIGEST_GROUP} holds {sorted(root)}, not {sorted(groups)} as digest_points "
                              "and digest_layers say")
    if layer_tables:
        _check_group(path, _member(path, root, "layers", h5py.Group), layer_tables, rows, (len(meta.digest_layers),))
    if final_tables:
        _check_group(path, _member(path, root, FINAL_GROUP, h5py.Group), final_tables, rows, ())
    return digested

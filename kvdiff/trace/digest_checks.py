"""A digest trace's own checks: /digests holds a hash and statistics dataset per listed point and
layer, each covering /digests/positions, and nothing else."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from kvdiff.trace.checks import _dataset, _member, malformed, read_positions
from kvdiff.trace.digest import DIGEST_STATS
from kvdiff.trace.format import DIGEST_GROUP, FINAL_GROUP, TraceMeta
from kvdiff.trace.points import FINAL_POINTS


def _check_point(path: Path, g: h5py.Group, point: str, rows: int) -> None:
    group = _member(path, g, point, h5py.Group)
    extra = sorted(set(group) - {"hash", "stats"})
    if extra:
        raise malformed(path, f"{group.name} holds {extra}: a digest is a hash and its stats")
    hashes, stats = _dataset(path, group, "hash"), _dataset(path, group, "stats")
    if hashes.ndim != 1 or hashes.dtype != np.int64 or hashes.shape[0] < rows:
        raise malformed(path, f"{hashes.name} must be int64 rows, {rows} or more, not {hashes.shape} {hashes.dtype}")
    if stats.shape[1:] != (len(DIGEST_STATS),) or stats.dtype != np.float32 or stats.shape[0] < rows:
        raise malformed(path, f"{stats.name} must be float32 rows of {len(DIGEST_STATS)} ({', '.join(DIGEST_STATS)}), "
                              f"{rows} or more, not {stats.shape} {stats.dtype}")


def check_digests(path: Path, f: h5py.File, meta: TraceMeta, positions: np.ndarray) -> np.ndarray:
    """The digests of a digest trace, checked; returns /digests/positions (empty for a full trace,
    which must hold no /digests)."""
    if meta.trace_mode != "digest":
        if DIGEST_GROUP in f:
            raise malformed(path, f"/{DIGEST_GROUP} in a trace of trace_mode {meta.trace_mode!r}")
        return np.zeros(0, dtype=np.int64)
    root = _member(path, f, DIGEST_GROUP, h5py.Group)
    digested = read_positions(path, root)
    if np.setdiff1d(positions, digested).size or np.setdiff1d(meta.kv_only_positions, digested).size:
        raise malformed(path, "positions or kv_only_positions hold positions that /digests/positions does not")
    rows = int(digested[-1]) + 1 if digested.size else 0
    layer_points = [p for p in meta.digest_points if p not in FINAL_POINTS]
    final_points = [p for p in meta.digest_points if p in FINAL_POINTS]
    groups = {"positions", *(["layers"] if layer_points and meta.digest_layers else []),
              *([FINAL_GROUP] if final_points else [])}
    if set(root) != groups:
        raise malformed(path, f"/{DIGEST_GROUP} holds {sorted(root)}, not {sorted(groups)} as digest_points "
                              "and digest_layers say")
    for layer in meta.digest_layers if layer_points else ():
        group = _member(path, root, f"layers/{layer}", h5py.Group)
        for point in layer_points:
            _check_point(path, group, point, rows)
    if final_points:
        for point in final_points:
            _check_point(path, root[FINAL_GROUP], point, rows)
    return digested

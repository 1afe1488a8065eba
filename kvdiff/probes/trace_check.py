"""Structure checks of an opened trace: what its metadata declares is there, with numeric types.

Only names, shapes and dtypes are read, so the check costs nothing next to reading rows. A trace
that fails it is damaged (or was not written by a trace writer) and is refused with one line,
before any analysis indexes into it. Nothing in a trace is ever unpickled or evaluated: object,
string and compound datasets where numbers belong are refused like any other damage.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from kvdiff.errors import TraceError
from kvdiff.probes.model_meta import ModelDims
from kvdiff.probes.points import ALL_POINTS, FINAL_POINTS, FINAL_NORMS, LAYER_NORMS, NORM_STATS
from kvdiff.probes.trace_format import DTYPE_ATTR, TraceMeta, point_group

CAPTURED_DTYPES = ("float32", "float16", "bfloat16", "float64")
STEP_FIELDS = ("step", "position", "token_id", "topk_ids", "topk_values", "margin")


class _Checker:
    """Collects the first structural fault of one trace as a TraceError."""

    def __init__(self, path: Path, f: h5py.File, meta: TraceMeta, positions: np.ndarray):
        self.path, self.f, self.meta, self.positions = path, f, meta, positions
        self.rows = int(positions[-1]) + 1 if positions.size else 0

    def damaged(self, what: str) -> TraceError:
        return TraceError(f"trace {self.path} is damaged: {what}; record it again")

    def numeric(self, name: str, ndim: int | None = None) -> h5py.Dataset:
        """The dataset `name`, which must exist and hold numbers (never objects or strings)."""
        ds = self.f.get(name)
        if not isinstance(ds, h5py.Dataset):
            raise self.damaged(f"{name} is missing")
        if ds.dtype.kind not in "biuf":
            raise self.damaged(f"{name} holds {ds.dtype} values where numbers belong")
        if ndim is not None and ds.ndim != ndim:
            raise self.damaged(f"{name} has {ds.ndim} dimensions, expected {ndim}")
        return ds

    def rows_of(self, name: str, row_shape: tuple[int, ...]) -> None:
        """A position-indexed dataset: one row per global position up to the last recorded one."""
        ds = self.numeric(name, 1 + len(row_shape))
        if ds.shape[1:] != row_shape:
            raise self.damaged(f"{name} has rows of shape {ds.shape[1:]}, expected {row_shape}")
        if ds.shape[0] < self.rows:
            raise self.damaged(f"{name} holds {ds.shape[0]} rows, fewer than the {self.rows} its positions need")
        captured = ds.attrs.get(DTYPE_ATTR, str(ds.dtype))
        stored = "uint16" if captured == "bfloat16" else captured
        if captured not in CAPTURED_DTYPES or str(ds.dtype) != stored:
            raise self.damaged(f"{name} stores {ds.dtype} rows labelled {captured!r}")

    def tables(self) -> None:
        p = self.positions
        if p.ndim != 1 or p.dtype.kind not in "iu" or (p.size and (p[0] < 0 or np.any(np.diff(p) <= 0))):
            raise self.damaged("its positions are not increasing non-negative integers")
        for name in ("input_ids", "generated_ids"):
            self.numeric(name, 1)
        lengths = {self.numeric(f"steps/{name}").shape[0] for name in STEP_FIELDS}
        if len(lengths) != 1 or self.numeric("steps/topk_ids", 2).shape != self.numeric("steps/topk_values", 2).shape:
            raise self.damaged("its steps table has fields of different lengths")

    def points(self) -> None:
        m = self.meta
        unknown = [p for p in m.points if p not in ALL_POINTS]
        if unknown:
            raise self.damaged(f"it declares unknown probe point(s) {', '.join(map(str, unknown))}")
        if any(not 0 <= layer < m.num_layers for layer in m.layers):
            raise self.damaged(f"it declares layers {list(m.layers)} of a {m.num_layers}-layer model")
        dims = ModelDims(m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.hidden_size, m.vocab_size,
                         m.attn_scale)
        for layer in list(m.layers) + [None]:
            group = point_group(layer)
            for point in m.points:
                if (point in FINAL_POINTS) == (layer is None):
                    self.rows_of(f"{group}/{point}", dims.point_shape(point))
            norms = FINAL_NORMS if layer is None else LAYER_NORMS
            for norm in (n for n in norms if n in m.points and f"{group}/norm_stats/{n}" in self.f):
                for stat in NORM_STATS:
                    self.rows_of(f"{group}/norm_stats/{norm}/{stat}", ())


def check_structure(path: Path, f: h5py.File, meta: TraceMeta, positions: np.ndarray) -> None:
    """TraceError (one line) unless every table, step field and declared probe dataset is there,
    numeric, and holds a row for every recorded position."""
    checker = _Checker(path, f, meta, positions)
    checker.tables()
    checker.points()

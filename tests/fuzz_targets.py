"""Fuzz targets: mutated traces fed to `kvdiff diff` and `kvdiff inspect`, mutated case files fed
to `kvdiff gate`, each run in-process through the typer app. The traces are full ones of a
synthetic decoder (`seeds`) or digest traces with a zoom window, as `kvdiff compare` writes them
by default (`digest_seeds`, from the tiny model).

The property (`check`, `invoke`): the command exits 0, 1, 2 or 3; no exception escapes; no
traceback is printed and kvdiff's code raises no warning (numpy's on NaN would print two lines);
on 2 or 3 stderr is exactly one `kvdiff: error: ...` line, and not the CLI's catch-all line for
unexpected exceptions (a crash the product did not explain). The gate target also fails on a case
that crashed inside the runner (reported there as an error outcome) and on JUnit XML that does not
parse; models are not loaded there, so valid cases end at model loading as error outcomes.

Used by tests/test_fuzz.py (a short deterministic run in CI) and scripts/fuzz.py (the long run).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import pickle
import re
import shutil
import tempfile
import time
import warnings
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import h5py
import numpy as np
from hypothesis import given, strategies as st
from typer.testing import CliRunner

import kvdiff
from kvdiff.engine import loading
from synthetic import Faults, SyntheticModel, write_trace
from kvdiff.cli import app
from kvdiff.errors import ModelLoadError
from kvdiff.trace.points import ALL_POINTS, NORM_STATS
from kvdiff.trace import ChunkRecord, TraceMeta

CATCH_ALL = "kvdiff: error: unexpected "
PROMPT = list(range(3, 11))
STEPS = 3
CHUNKS = [ChunkRecord("system", (0, 3), "s", "hit", (0, 3)), ChunkRecord("user", (4, 7), "u", "miss", (0, 3))]
PROVENANCE = [([0, 1, 2, 3], "system", 0, [0, 1, 2, 3], True), ([4, 5, 6, 7], "user", 1, [0, 1, 2, 3], False)]
ATTRS = ("format", "schema_version", "complete") + TraceMeta.SCALARS + (
    "messages_json", "chunks_json", "points", "layers", "eps", "kvdiff_dtype")
SPECIAL_NUMBERS = (math.nan, math.inf, -math.inf, -1, 0, 1, 2 ** 31, 2 ** 62, -(2 ** 63), 1e38, -1e-45, 65504)
HOSTILE_TEXT = ("[/bold]", "[red]x[/red]", "[link=file:///etc/passwd]x", "\x1b[31mred", "a\nb", "\u2028", "\x85",
                "\u202e", "<script>alert(1)</script>", "%s%n{0}", "\x00", "\ud800",
                "x\nkvdiff: error: forged\x1b[2J", "\r\x1b]0;title\x07", "\x9b31m")
NAMES = HOSTILE_TEXT + ALL_POINTS + NORM_STATS + (
    "0", "1", "2", "99", "-1", "layers", "final", "norms", "steps", "provenance", "positions", "input_ids",
    "generated_ids", "norm_stats", "chunk")


# -- seed traces ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Seed:
    """A valid trace, its HDF5 object paths, and the byte ranges that hold raw data."""

    path: Path
    objects: tuple[str, ...]
    raw: tuple[tuple[int, int], ...]      # (offset, size) of every raw data block

    def metadata_offset(self, fraction: float) -> int:
        """An offset outside the raw data blocks (HDF5 structure, heaps, attributes)."""
        size = self.path.stat().st_size
        covered = np.zeros(size, dtype=bool)
        for offset, length in self.raw:
            covered[offset:offset + length] = True
        free = np.flatnonzero(~covered)
        return int(free[min(int(fraction * free.size), free.size - 1)])


def _describe(path: Path) -> Seed:
    objects: list[str] = []
    raw: list[tuple[int, int]] = []
    with h5py.File(path, "r") as f:
        def visit(name: str, obj) -> None:
            objects.append(name)
            if isinstance(obj, h5py.Dataset):
                if obj.chunks is None:
                    offset = obj.id.get_offset()
                    if offset is not None:
                        raw.append((offset, obj.id.get_storage_size()))
                else:
                    for i in range(obj.id.get_num_chunks()):
                        info = obj.id.get_chunk_info(i)
                        raw.append((info.byte_offset, info.size))

        f.visititems(visit)
    return Seed(path, tuple(objects), tuple(raw))


@lru_cache(maxsize=None)
def seeds() -> dict[str, Seed]:
    """Small valid traces of the synthetic decoder, written once per process."""
    folder = Path(tempfile.mkdtemp(prefix="kvdiff-fuzz-seeds-"))
    atexit.register(shutil.rmtree, folder, True)
    model = SyntheticModel(layers=2, hidden=16, heads=4, kv_heads=2, vocab=32, seed=3)
    reference = write_trace(model, folder / "reference.h5", PROMPT, STEPS)
    candidate = write_trace(model, folder / "candidate.h5", PROMPT, STEPS, strategy="isolated-local",
                            faults=Faults(encoded={p: p - 4 for p in range(4, 8)}, context_start={p: 4 for p in range(4, 8)}),
                            chunks=CHUNKS, provenance=PROVENANCE)
    return {"reference": _describe(reference), "candidate": _describe(candidate)}


DIGEST_MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
                   {"role": "user", "content": "What is the capital of France?"}]


@lru_cache(maxsize=None)
def digest_seeds() -> dict[str, Seed]:
    """The traces `kvdiff compare` writes by default (digests of every row, full rows in the zoom
    window), from the tiny model with a divergent strategy, written once per process."""
    folder = Path(tempfile.mkdtemp(prefix="kvdiff-fuzz-digest-seeds-"))
    atexit.register(shutil.rmtree, folder, True)
    kvdiff.compare(DIGEST_MESSAGES, model="tiny-llama", strategy="isolated-local", max_new_tokens=STEPS,
                   out=folder / "run")
    return {side: _describe(folder / "run" / f"{side}.h5") for side in ("reference", "candidate")}


# -- trace mutations --------------------------------------------------------------------------

def _pick(seq: tuple[str, ...], index: int) -> str:
    return seq[index % len(seq)]


@dataclass(frozen=True)
class Overwrite:
    """Overwrite (or XOR) bytes at an offset, anywhere or only in HDF5 structure (outside raw data)."""

    fraction: float
    data: bytes
    structure: bool
    xor: bool

    def apply(self, path: Path, seed: Seed) -> None:
        buf = bytearray(path.read_bytes())
        if not buf:
            return
        offset = min(seed.metadata_offset(self.fraction) if self.structure else int(self.fraction * len(buf)), len(buf) - 1)
        old = buf[offset:offset + len(self.data)]
        buf[offset:offset + len(self.data)] = bytes(a ^ b for a, b in zip(old, self.data)) if self.xor else self.data
        path.write_bytes(bytes(buf))


@dataclass(frozen=True)
class Truncate:
    """Cut the file at a fraction of its length."""

    fraction: float

    def apply(self, path: Path, seed: Seed) -> None:
        data = path.read_bytes()
        path.write_bytes(data[: int(self.fraction * len(data))])


def _h5_write(path: Path) -> h5py.File:
    return h5py.File(path, "r+")


def _ignore_h5_refusal() -> contextlib.suppress:
    """Mutations h5py refuses (a name it cannot create, a value it cannot store, an object an
    earlier mutation removed) are no-ops."""
    return contextlib.suppress(ValueError, TypeError, KeyError, OSError, RuntimeError, OverflowError)


@dataclass(frozen=True)
class Delete:
    """Delete a group or dataset."""

    index: int

    def apply(self, path: Path, seed: Seed) -> None:
        with _h5_write(path) as f:
            del f[_pick(seed.objects, self.index)]


@dataclass(frozen=True)
class Rename:
    """Move a group or dataset to another name in its parent group."""

    index: int
    name: str

    def apply(self, path: Path, seed: Seed) -> None:
        source = _pick(seed.objects, self.index)
        parent = source.rpartition("/")[0]
        with _h5_write(path) as f:
            f.move(source, f"{parent}/{self.name}" if parent else self.name)


@dataclass(frozen=True)
class Replace:
    """Replace a dataset or group by a dataset of another shape and dtype (or an empty group)."""

    index: int
    value: object        # a numpy array, or None for an empty group

    def apply(self, path: Path, seed: Seed) -> None:
        name = _pick(seed.objects, self.index)
        with _h5_write(path) as f:
            attrs = dict(f[name].attrs)
            del f[name]
            if self.value is None:
                f.create_group(name)
                return
            ds = f.create_dataset(name, data=self.value)
            for key, value in attrs.items():
                ds.attrs[key] = value


MAX_EDITED = 1 << 22         # elements a mutation reads to edit: not a dataset DeclareHuge made huge


def _edit_elements(path: Path, seed: Seed, index: int, kinds: str, edit: Callable[[np.ndarray], None]) -> None:
    """Apply `edit` to the flat elements of a non-empty dataset whose dtype kind is in `kinds`."""
    with _h5_write(path) as f:
        ds = f[_pick(seed.objects, index)]
        if not isinstance(ds, h5py.Dataset) or not 0 < ds.size <= MAX_EDITED or ds.dtype.kind not in kinds:
            return
        data = ds[()]
        with np.errstate(all="ignore"):
            edit(data.reshape(-1))
        ds[()] = data


@dataclass(frozen=True)
class Poke:
    """Write a special number (NaN, Inf, -1, huge) at one element of a numeric dataset."""

    index: int
    element: float
    number: float

    def apply(self, path: Path, seed: Seed) -> None:
        _edit_elements(path, seed, self.index, "iufb", self._poke)

    def _poke(self, flat: np.ndarray) -> None:
        i = min(int(self.element * flat.size), flat.size - 1)
        if flat.dtype.kind == "f":
            flat[i] = self.number
        elif math.isfinite(self.number):
            info = np.iinfo(flat.dtype) if flat.dtype.kind in "iu" else None
            flat[i] = int(self.number) if info is None else min(max(int(self.number), info.min), info.max)


@dataclass(frozen=True)
class Add:
    """Create a new dataset at a new path (an extra layer, an unknown point)."""

    name: str
    value: object

    def apply(self, path: Path, seed: Seed) -> None:
        with _h5_write(path) as f:
            f.create_dataset(self.name, data=self.value)


@dataclass(frozen=True)
class SetAttr:
    """Set (or add) an attribute of the root or of any object to an arbitrary value."""

    index: int           # -1: the root group
    name: str
    value: object

    def apply(self, path: Path, seed: Seed) -> None:
        with _h5_write(path) as f:
            obj = f if self.index < 0 else f[_pick(seed.objects, self.index)]
            obj.attrs[self.name] = self.value


@dataclass(frozen=True)
class DelAttr:
    """Delete an attribute of the root or of any object."""

    index: int
    name: str

    def apply(self, path: Path, seed: Seed) -> None:
        with _h5_write(path) as f:
            obj = f if self.index < 0 else f[_pick(seed.objects, self.index)]
            del obj.attrs[self.name]


@dataclass(frozen=True)
class SetIds:
    """Rewrite input_ids, generated_ids or positions (still a valid-looking 1-D int64 dataset)."""

    name: str
    values: tuple[int, ...]

    def apply(self, path: Path, seed: Seed) -> None:
        with _h5_write(path) as f:
            del f[self.name]
            f.create_dataset(self.name, data=np.array(self.values, dtype=np.int64))


@dataclass(frozen=True)
class Recode:
    """Store a probe dataset as float16, float64 or bfloat16 (uint16), its kvdiff_dtype to match."""

    index: int
    dtype: str

    def apply(self, path: Path, seed: Seed) -> None:
        name = _pick(seed.objects, self.index)
        with _h5_write(path) as f:
            ds = f[name]
            if not isinstance(ds, h5py.Dataset) or "kvdiff_dtype" not in ds.attrs or ds.dtype != np.float32 \
                    or ds.size > MAX_EDITED:
                return
            data = ds[()]
            with np.errstate(over="ignore"):        # huge float32 values become Inf in float16
                coded = (data.view(np.uint32) >> 16).astype(np.uint16) if self.dtype == "bfloat16" \
                    else data.astype(self.dtype)
            del f[name]
            f.create_dataset(name, data=coded).attrs["kvdiff_dtype"] = self.dtype


@dataclass(frozen=True)
class Scale:
    """Multiply the elements of a float dataset from some element on (a planted divergence)."""

    index: int
    start: float
    factor: float

    def apply(self, path: Path, seed: Seed) -> None:
        _edit_elements(path, seed, self.index, "f", self._scale)

    def _scale(self, flat: np.ndarray) -> None:
        flat[int(self.start * flat.size):] *= self.factor


@dataclass(frozen=True)
class Keep:
    """Keep only some probe points and layers, consistently (attributes and datasets)."""

    points: tuple[str, ...]
    layers: tuple[int, ...]

    def apply(self, path: Path, seed: Seed) -> None:
        with _h5_write(path) as f:
            f.attrs["points"] = json.dumps([p for p in ALL_POINTS if p in self.points])
            f.attrs["layers"] = np.array(sorted(self.layers), dtype=np.int64)
            for layer in list(f["layers"]):
                if int(layer) not in self.layers:
                    del f[f"layers/{layer}"]
                    continue
                for point in [p for p in f[f"layers/{layer}"] if p in ALL_POINTS and p not in self.points]:
                    del f[f"layers/{layer}/{point}"]
            for point in [p for p in f["final"] if p in ALL_POINTS and p not in self.points]:
                del f[f"final/{point}"]


@dataclass(frozen=True)
class SetProvenance:
    """Rewrite the provenance table with well-typed, arbitrary rows."""

    rows: tuple[tuple[int, str, int, int, bool], ...]

    def apply(self, path: Path, seed: Seed) -> None:
        with _h5_write(path) as f:
            if "provenance" in f:
                del f["provenance"]
            g = f.create_group("provenance")
            for i, name in enumerate(("positions", "chunk", "prefill_id", "encoded_position", "reused")):
                values = [r[i] for r in self.rows]
                if name == "chunk":
                    g.create_dataset(name, data=values, dtype=h5py.string_dtype())
                else:
                    g.create_dataset(name, data=np.array(values, dtype=bool if name == "reused" else np.int64))


@dataclass(frozen=True)
class SetSteps:
    """Rewrite the steps table: G steps of top-k, arbitrary step numbers, positions and values."""

    steps: tuple[int, ...]
    k: int
    value: float

    def apply(self, path: Path, seed: Seed) -> None:
        g_count = len(self.steps)
        with _h5_write(path) as f:
            del f["steps"]
            g = f.create_group("steps")
            ints = np.array(self.steps, dtype=np.int64)
            for name in ("step", "position", "token_id"):
                g.create_dataset(name, data=ints)
            g.create_dataset("topk_ids", data=np.zeros((g_count, self.k), dtype=np.int64))
            g.create_dataset("topk_values", data=np.full((g_count, self.k), self.value, dtype=np.float32))
            g.create_dataset("margin", data=np.full(g_count, self.value))


@dataclass(frozen=True)
class Outward:
    """Point a dataset (or a new object) outside the file: an external or soft link, external raw
    storage, a virtual dataset of another file, or a filter HDF5 would load as a plugin."""

    index: int
    kind: str

    def apply(self, path: Path, seed: Seed) -> None:
        other = seeds()["reference"].path
        with _h5_write(path) as f:
            name = _pick(seed.objects, self.index)
            if self.kind == "new-external-link":
                f[f"{name.rpartition('/')[0] or ''}/zz_external".lstrip("/")] = h5py.ExternalLink(str(other), "/")
                return
            ds = f[name]
            if not isinstance(ds, h5py.Dataset) and self.kind not in ("external-link", "soft-link"):
                return
            attrs = dict(ds.attrs)
            shape, dtype = (ds.shape, ds.dtype) if isinstance(ds, h5py.Dataset) else ((), None)
            del f[name]
            if self.kind == "external-link":
                f[name] = h5py.ExternalLink(str(other), "/" + name)
                return
            if self.kind == "soft-link":
                f[name] = h5py.SoftLink("/" + _pick(seed.objects, self.index + 1))
                return
            nbytes = max(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, 1)
            if self.kind == "external-storage":
                made = f.create_dataset(name, shape=shape, dtype=dtype, external=[("/etc/passwd", 0, nbytes)])
            elif self.kind == "virtual-dataset":
                layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
                layout[...] = h5py.VirtualSource(str(other), name, shape=shape)
                made = f.create_virtual_dataset(name, layout)
            else:
                made = f.create_dataset(name, shape=shape, dtype=dtype, chunks=True if shape else None,
                                        compression=32001, allow_unknown_filter=True)
            made.attrs.update(attrs)


@dataclass(frozen=True)
class CutSteps:
    """Keep the first `rows` rows of every /steps dataset (lengths that disagree with generated_ids)."""

    rows: int

    def apply(self, path: Path, seed: Seed) -> None:
        with _h5_write(path) as f:
            for name in list(f["steps"]):
                data = f[f"steps/{name}"][: self.rows]
                del f[f"steps/{name}"]
                f[f"steps/{name}"] = data


@dataclass(frozen=True)
class HugeChunks:
    """A chunk table of `count` copies of one span (overlapping, or far past the prompt)."""

    count: int
    span: tuple[int, int]

    def apply(self, path: Path, seed: Seed) -> None:
        entry = {"name": "c", "positions": list(self.span), "hash": "h", "cache": "miss",
                 "encoded_positions": list(self.span)}
        with _h5_write(path) as f:
            f.attrs["chunks_json"] = json.dumps([entry] * self.count)


@dataclass(frozen=True)
class DeclareHuge:
    """Re-create a dataset declared `length` rows long, chunked and unwritten (no bytes in the file)."""

    index: int
    length: int

    def apply(self, path: Path, seed: Seed) -> None:
        name = _pick(seed.objects, self.index)
        with _h5_write(path) as f:
            ds = f[name]
            if not isinstance(ds, h5py.Dataset) or not ds.shape:
                return
            attrs, shape, dtype = dict(ds.attrs), ds.shape, ds.dtype
            del f[name]
            made = f.create_dataset(name, shape=(self.length, *shape[1:]), maxshape=(None, *shape[1:]),
                                    chunks=(64, *shape[1:]), dtype=dtype)
            made.attrs.update(attrs)


class Unpicklable:
    """Unpickling this sets `Unpicklable.ran`: a trace reader that unpickles attributes is caught."""

    ran = False

    def __reduce__(self) -> tuple:
        return (_mark_unpickled, ())


def _mark_unpickled() -> None:
    Unpicklable.ran = True


PICKLE_PAYLOAD = pickle.dumps(Unpicklable())

texts = st.text(max_size=12) | st.sampled_from(HOSTILE_TEXT)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


@st.composite
def chunk_tables(draw) -> list:
    """Chunk tables with the right keys but arbitrary (often wrong) values."""
    keys = ("name", "positions", "hash", "cache", "encoded_positions")
    position_pairs = st.lists(st.integers(-3, 2 ** 63) | st.sampled_from([0, 3, 4, 7, 9]), min_size=0, max_size=3)
    tables = []
    for _ in range(draw(st.integers(0, 3))):
        table = {k: draw(position_pairs if "positions" in k else st.sampled_from(["hit", "miss", "system"]) | json_values)
                 for k in keys if draw(st.integers(0, 9))}
        tables.append(table)
    return tables


json_texts = st.one_of(
    json_values.map(lambda v: json.dumps(v)),
    chunk_tables().map(json.dumps),
    st.lists(st.sampled_from(ALL_POINTS) | st.text(max_size=6), max_size=5).map(json.dumps),
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", 3]), "content": json_values}),
             max_size=3).map(json.dumps),
    st.text(max_size=20),
)

_DTYPES = (np.int8, np.int32, np.int64, np.uint16, np.uint64, np.float16, np.float32, np.float64, np.bool_,
           np.complex64)


@st.composite
def arrays(draw) -> np.ndarray:
    """Small arrays of assorted dtypes and shapes, numeric or not."""
    shape = tuple(draw(st.lists(st.integers(0, 12), max_size=3)))
    kind = draw(st.sampled_from(("numeric", "numeric", "numeric", "strings", "bytes", "compound", "special")))
    size = int(np.prod(shape, dtype=np.int64))
    if kind == "strings":
        return np.array([draw(st.text(max_size=6)) for _ in range(size)], dtype=h5py.string_dtype()).reshape(shape)
    if kind == "bytes":
        return np.full(shape, draw(st.binary(min_size=1, max_size=6)))
    if kind == "compound":
        return np.zeros(shape, dtype=[("a", np.int64), ("b", np.float32)])
    dtype = draw(st.sampled_from(_DTYPES))
    values = np.arange(size, dtype=np.float64) - 2
    if kind == "special" and size:
        values[draw(st.integers(0, size - 1))] = draw(st.sampled_from(SPECIAL_NUMBERS))
    with np.errstate(all="ignore"):
        return values.astype(dtype).reshape(shape)


attr_values = st.one_of(
    st.integers(-(2 ** 63), 2 ** 63 - 1),
    st.floats(),
    st.booleans(),
    st.text(max_size=30),
    st.sampled_from(HOSTILE_TEXT),
    json_texts,
    st.binary(min_size=1, max_size=12).map(np.bytes_),
    st.just(np.void(PICKLE_PAYLOAD)),
    st.integers(-5, 100).map(np.int64),
    arrays(),
)

fractions = st.floats(0, 1, exclude_max=True)
small_ints = st.integers(-2, 40) | st.sampled_from([2 ** 31, 2 ** 62])
spans = st.tuples(st.integers(0, 12), st.integers(0, 12)).map(sorted)
valid_chunk_tables = st.lists(st.builds(
    lambda name, span, cache, enc: {"name": name, "positions": span, "hash": name, "cache": cache,
                                    "encoded_positions": enc},
    st.sampled_from(("system", "user", "x", "") + HOSTILE_TEXT), spans, st.sampled_from(["hit", "miss"]), spans), max_size=4)
object_index = st.integers(0, 400)
trace_mutations = st.one_of(
    st.builds(Overwrite, fractions, st.integers(1, 255).map(lambda b: bytes([b])), st.booleans(), st.just(True)),
    st.builds(Overwrite, fractions, st.binary(min_size=1, max_size=16), st.booleans(), st.booleans()),
    st.builds(Truncate, fractions),
    st.builds(Delete, object_index),
    st.builds(Rename, object_index, st.sampled_from(NAMES) | st.text(min_size=1, max_size=8)),
    st.builds(Replace, object_index, st.none() | arrays()),
    st.builds(Poke, object_index, fractions, st.sampled_from(SPECIAL_NUMBERS)),
    st.builds(Add, st.builds("/".join, st.lists(st.sampled_from(NAMES), min_size=1, max_size=3)), arrays()),
    st.builds(SetAttr, st.integers(-1, 400), st.sampled_from(ATTRS) | st.text(min_size=1, max_size=8), attr_values),
    st.builds(DelAttr, st.integers(-1, 400), st.sampled_from(ATTRS)),
    st.builds(SetIds, st.sampled_from(("input_ids", "generated_ids")), st.lists(small_ints, max_size=12).map(tuple)),
    st.builds(SetIds, st.just("positions"), st.sets(st.integers(0, 11), max_size=11).map(lambda v: tuple(sorted(v)))),
    st.builds(Recode, object_index, st.sampled_from(("float16", "float64", "bfloat16"))),
    st.builds(Scale, object_index, fractions, st.sampled_from((1 + 1e-7, 1.001, 2.0, -1.0, 0.0, math.inf))),
    st.builds(Keep, st.sets(st.sampled_from(ALL_POINTS)).map(tuple), st.sets(st.integers(0, 1)).map(tuple)),
    st.builds(SetProvenance, st.lists(st.tuples(small_ints, st.sampled_from(("system", "user", "", "z") + HOSTILE_TEXT),
                                                small_ints, small_ints, st.booleans()), max_size=12).map(tuple)),
    st.builds(SetSteps, st.lists(small_ints, max_size=5).map(tuple), st.integers(0, 6),
              st.sampled_from(SPECIAL_NUMBERS)),
    st.builds(SetAttr, st.just(-1), st.just("chunks_json"), valid_chunk_tables.map(json.dumps)),
    st.builds(SetAttr, st.just(-1), st.just("dtype"), st.sampled_from(("float32", "bfloat16", "float16", "int8", ""))),
    # issue #28: objects outside the file, text that forges lines, tables that disagree, huge sizes
    st.builds(Outward, object_index, st.sampled_from(("external-link", "soft-link", "external-storage",
                                                      "virtual-dataset", "plugin-filter", "new-external-link"))),
    st.builds(SetAttr, st.just(-1), st.sampled_from(TraceMeta.SCALARS), st.sampled_from(HOSTILE_TEXT)),
    st.builds(CutSteps, st.integers(0, STEPS + 1)),
    st.builds(HugeChunks, st.sampled_from((2, 10, 1000, 100_000)), st.sampled_from(((0, 0), (0, 3), (0, 10 ** 12)))),
    st.builds(DeclareHuge, object_index, st.sampled_from((2 ** 20, 2 ** 31, 2 ** 40))),
    st.builds(SetAttr, st.just(-1), st.sampled_from(("vocab_size", "hidden_size", "num_layers", "head_dim")),
              st.sampled_from((2 ** 20, 2 ** 26, 2 ** 40)).map(np.int64)),
)


def _is_bytes_op(op) -> bool:
    return isinstance(op, (Overwrite, Truncate))


def mutate(seed: Seed, ops: list, path: Path) -> Path:
    """Copy `seed` to `path` and apply `ops` (HDF5-level ones first, byte-level ones after)."""
    shutil.copyfile(seed.path, path)
    for op in sorted(ops, key=_is_bytes_op):
        with _ignore_h5_refusal():
            op.apply(path, seed)
    return path


# -- running the CLI and checking the property --------------------------------------------------

class FuzzFailure(AssertionError):
    """The property does not hold for one input."""


def _runner() -> CliRunner:
    return CliRunner()


# Characters that must never reach a stream raw: C0 and C1 controls (ESC, CR, BEL, CSI) and line
# separators; a trace's or case file's text shows them as escapes (issue #28).
_RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")
BUDGET_SECONDS = 60.0         # one command on a tiny input: more means work grew with something else


def check(result, command: list[str], seconds: float = 0.0) -> None:
    """The contract: exit 0/1/2/3, no escaped exception or traceback, one specific error line on 2/3;
    on any exit no raw control character in stdout or stderr, at most one `kvdiff: error:` line
    (a forged one would be a second), and the command within BUDGET_SECONDS."""
    where = " ".join(command)
    exc = result.exception
    if exc is not None and not isinstance(exc, SystemExit):
        raise FuzzFailure(f"{where}: {type(exc).__name__} escaped: {exc}") from exc
    if result.exit_code not in (0, 1, 2, 3):
        raise FuzzFailure(f"{where}: exit code {result.exit_code}; stderr {result.stderr!r}")
    if "Traceback" in result.stderr or "Traceback" in result.stdout:
        raise FuzzFailure(f"{where}: a traceback was printed: {result.stderr[-2000:]!r}")
    if result.exit_code in (2, 3):
        lines = result.stderr.splitlines()
        if len(lines) != 1 or not lines[0].startswith("kvdiff: error: "):
            raise FuzzFailure(f"{where}: exit {result.exit_code} with stderr {result.stderr!r} (want one error line)")
        if lines[0].startswith(CATCH_ALL):
            raise FuzzFailure(f"{where}: crashed into the catch-all: {lines[0]}")
    for name, text in (("stdout", result.stdout), ("stderr", result.stderr)):
        raw = _RAW.search(text)
        if raw:
            raise FuzzFailure(f"{where}: a raw control character {raw.group()!r} reached {name}: "
                              f"{text[max(raw.start() - 80, 0):raw.end() + 40]!r}")
    if sum(line.startswith("kvdiff: error: ") for line in result.stderr.splitlines()) > 1:
        raise FuzzFailure(f"{where}: more than one error line: {result.stderr[-2000:]!r}")
    if seconds > BUDGET_SECONDS:
        raise FuzzFailure(f"{where}: took {seconds:.0f} s, more than {BUDGET_SECONDS:.0f} s")


EXIT_CODES: Counter = Counter()       # exit code -> examples, for the long run's summary
LAST_EXIT = [0]                       # the exit code of the last invocation


def invoke(args: list[str]) -> None:
    """Run `kvdiff ARGS` in-process and check the property; a warning kvdiff's code raises (numpy's
    on NaN, say) would reach stderr as two lines of noise, so it fails the property too."""
    logging.getLogger().handlers.clear()       # the CLI's basicConfig binds the stderr of this invocation
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _runner().invoke(app, args)
    EXIT_CODES[result.exit_code] += 1
    LAST_EXIT[0] = result.exit_code
    check(result, args, time.perf_counter() - start)
    ours = [w for w in caught if f"{os.sep}kvdiff{os.sep}" in w.filename]
    if ours:
        w = ours[0]
        raise FuzzFailure(f"{' '.join(args)}: {w.category.__name__} at {Path(w.filename).name}:{w.lineno}: {w.message}")


def reaches_outside(path: Path) -> bool:
    """Whether an HDF5 file (that h5py opens) holds a link that is not hard, or a dataset whose bytes
    are not in it: the oracle for the refusal `kvdiff diff` and `inspect` must give (exit 2)."""
    try:
        with h5py.File(path, "r") as f:
            found = []

            def visit(raw: bytes):
                kind = f.id.links.get_info(raw).type
                if kind != h5py.h5l.TYPE_HARD:
                    found.append(raw)
                    return True
                obj = f.get(raw.decode("utf-8", "replace"))
                if isinstance(obj, h5py.Dataset):
                    plist = obj.id.get_create_plist()
                    filters = {plist.get_filter(i)[0] for i in range(plist.get_nfilters())}
                    if plist.get_layout() == h5py.h5d.VIRTUAL or plist.get_external_count() or filters - {1, 2, 3, 4, 5, 6, 32000}:
                        found.append(raw)
                        return True
                return None

            f.id.links.visit(visit)
            return bool(found)
    except Exception:            # a file HDF5 cannot read: kvdiff refuses it for that
        return False


def _expect_refused(mutated: Path, args: list[str]) -> None:
    if LAST_EXIT[0] != 2 and reaches_outside(mutated):
        raise FuzzFailure(f"{' '.join(args)}: a trace reaching outside its file was not refused "
                          f"(exit {LAST_EXIT[0]})")


def run_diff(ops: list, target: str, html: bool, baseline: bool, digest: bool) -> None:
    """`kvdiff diff` with the reference, the candidate or both mutated; report.json always written;
    `digest`: traces as `kvdiff compare` writes them (digest_seeds) instead of full ones."""
    s = digest_seeds() if digest else seeds()
    with tempfile.TemporaryDirectory(prefix="kvdiff-fuzz-") as tmp:
        folder = Path(tmp)
        mutated = mutate(s[target if target != "same" else "candidate"], ops, folder / "mutated.h5")
        ref = mutated if target in ("reference", "same") else s["reference"].path
        cand = mutated if target in ("candidate", "same") else s["candidate"].path
        args = ["diff", str(ref), str(cand), "--json", str(folder / "report.json")]
        if html:
            args += ["--html", str(folder / "report.html")]
        if baseline:
            args += ["--baseline", str(mutated)]
        invoke(args)
        _expect_refused(mutated, args)
        if Unpicklable.ran:
            raise FuzzFailure("a trace attribute was unpickled")


def run_inspect(ops: list, target: str, digest: bool) -> None:
    s = digest_seeds() if digest else seeds()
    with tempfile.TemporaryDirectory(prefix="kvdiff-fuzz-") as tmp:
        mutated = mutate(s[target], ops, Path(tmp) / "mutated.h5")
        invoke(["inspect", str(mutated)])
        _expect_refused(mutated, ["inspect", str(mutated)])
        if Unpicklable.ran:
            raise FuzzFailure("a trace attribute was unpickled")


# -- gate case files -----------------------------------------------------------------------------

GATE_KEYS = ("name", "system", "prompt", "messages", "model", "strategy", "numerics", "max_new_tokens",
             "chunk_size", "recompute_ratio", "dtype", "device", "capture", "layers")
GOOD_CASE = {"name": "seeds", "system": "You are a helpful assistant.", "prompt": "What is the capital of France?",
             "strategy": "prefix", "numerics": "exact", "max_new_tokens": 4, "model": "tiny-llama",
             "capture": "k,v", "layers": "0-1"}
odd_text = st.text(alphabet=st.characters(codec="utf-8"), max_size=12) | st.sampled_from(
    ("", " ", "\ufeff", "é", "😀" * 3, "a" * 300, "0-99999999999", "-1", "0-3,29", "k,v,zz", "nan") + HOSTILE_TEXT)
toml_scalars = st.one_of(
    odd_text, st.integers(-(2 ** 63), 2 ** 63 - 1), st.integers(-2, 40), st.floats(), st.booleans(),
    st.sampled_from(["prefix", "none", "blend", "exact", "fast", "float32", "bf16", "cpu", "cuda:9", "tiny-llama"]))
TYPED_VALUES = {
    "max_new_tokens": st.integers(-2, 200_000) | st.integers(-(2 ** 63), 2 ** 63 - 1),
    "chunk_size": st.integers(-2, 100) | st.integers(-(2 ** 63), 2 ** 63 - 1),
    "recompute_ratio": st.floats() | st.integers(-2, 2),
    "strategy": st.sampled_from(["none", "prefix", "isolated-local", "isolated-global", "rerotate", "blend"]) | odd_text,
    "numerics": st.sampled_from(["exact", "fast"]) | odd_text,
}
toml_values = st.recursive(toml_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.sampled_from(["role", "content", "x"]) | odd_text, inner, max_size=3),
                           max_leaves=8)


def _toml_key(key: str) -> str:
    return json.dumps(key, ensure_ascii=False)


def toml_value(value) -> str:
    """A value as TOML text (strings JSON-escaped, which TOML basic strings accept, surrogates aside)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


def toml_cases(cases: list[dict], extra: dict) -> str:
    lines = [f"{_toml_key(k)} = {toml_value(v)}" for k, v in extra.items()]
    for case in cases:
        lines.append("[[case]]")
        lines += [f"{_toml_key(k)} = {toml_value(v)}" for k, v in case.items()]
    return "\n".join(lines) + "\n"


def one_in(n: int) -> st.SearchStrategy[bool]:
    """True about once in `n` draws (st.integers would favour its bounds)."""
    return st.sampled_from((False,) * (n - 1) + (True,))


@st.composite
def case_tables(draw) -> dict:
    """A case: the good one with keys dropped, changed to odd values, or added."""
    case = {k: v for k, v in GOOD_CASE.items() if not draw(one_in(10))}
    if "name" in case:
        case["name"] = f"case {draw(st.integers(0, 10 ** 6))}"
    for key in draw(st.lists(st.sampled_from(GATE_KEYS), max_size=2)):
        case[key] = draw(toml_values if draw(one_in(5)) else TYPED_VALUES.get(key, odd_text))
    if draw(one_in(20)):
        case[draw(odd_text)] = draw(toml_values)
    if draw(one_in(4)):
        case.pop("prompt", None), case.pop("system", None)
        message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": odd_text})
        case["messages"] = draw(st.lists(message | st.dictionaries(st.sampled_from(["role", "content", "x"]),
                                                                   st.sampled_from(["user", "robot"]) | toml_values,
                                                                   max_size=3), max_size=3))
    return case


@st.composite
def text_mutations(draw, text: str) -> str:
    """`text` with a few characters deleted, inserted or replaced."""
    chars = list(text)
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(chars)))
        op = draw(st.sampled_from(("delete", "insert", "replace")))
        new = draw(st.text(min_size=1, max_size=3) | st.sampled_from(list("[]{}=\"'\n#.,")))
        if op == "delete":
            del chars[i:i + draw(st.integers(1, 20))]
        elif op == "insert":
            chars[i:i] = list(new)
        else:
            chars[i:i + len(new)] = list(new)
    return "".join(chars)


def _utf8(text: str) -> bytes:
    """A case file's bytes; a lone surrogate (HOSTILE_TEXT holds one) stays as its invalid bytes."""
    return text.encode("utf-8", "surrogatepass")


GOOD_FILE = toml_cases([GOOD_CASE, {**GOOD_CASE, "name": "fast", "numerics": "fast"}], {})
case_files = st.one_of(
    st.builds(toml_cases, st.lists(case_tables(), max_size=3), st.just({})).map(_utf8),
    st.builds(toml_cases, st.lists(case_tables(), max_size=3), st.just({})).map(_utf8),
    st.builds(toml_cases, st.lists(case_tables(), max_size=2),
              st.dictionaries(st.sampled_from(["title", "case", "x"]), toml_values, max_size=1)).map(_utf8),
    text_mutations(GOOD_FILE).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.text(max_size=60).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.binary(max_size=60),
)


class _CaseCrashes(logging.Handler):
    """Collects the gate runner's log records of cases that crashed (not a KvdiffError)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.crashes: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "crashed" in record.getMessage():
            error = record.exc_info[1] if record.exc_info else None
            self.crashes.append(f"{record.getMessage()}: {type(error).__name__}: {error}")


class _NoModels(ModelLoadError):
    """What the fuzzed gate gets instead of a model: valid cases stop at loading, as an error outcome."""


def _no_model(name: str, *args, **kwargs) -> None:
    raise _NoModels(f"fuzzing: not loading model {name!r}")


def run_gate(content: bytes) -> None:
    """`kvdiff gate` on a case file; models are not loaded (every valid case ends as an error outcome)."""
    crashes = _CaseCrashes()
    runner_log = logging.getLogger("kvdiff.gate.runner")
    with tempfile.TemporaryDirectory(prefix="kvdiff-fuzz-") as tmp:
        folder = Path(tmp)
        cases = folder / "cases.toml"
        cases.write_bytes(content)
        junit = folder / "junit.xml"
        args = ["gate", str(cases), "--junit", str(junit), "--out", str(folder / "out")]
        # the pipeline imports load_model from its module when it runs: that is the one to replace
        # (replacing kvdiff.load_model alone let valid cases load tiny-llama and run, ~10 s each)
        real_load, loading.load_model = loading.load_model, _no_model
        runner_log.addHandler(crashes)
        runner_log.setLevel(logging.DEBUG)
        runner_log.propagate = False
        try:
            invoke(args)
        finally:
            loading.load_model = real_load
            runner_log.removeHandler(crashes)
            runner_log.setLevel(logging.NOTSET)
            runner_log.propagate = True
        if crashes.crashes:
            raise FuzzFailure(f"gate: a case crashed: {crashes.crashes[0]}")
        if junit.exists():
            try:
                ET.parse(junit)
            except ET.ParseError as exc:
                raise FuzzFailure(f"gate: the JUnit XML does not parse: {exc}") from None


# -- the targets: what each feeds the CLI --------------------------------------------------------

trace_ops = st.lists(trace_mutations, min_size=1, max_size=4)
TARGETS: dict[str, tuple[Callable[..., None], dict[str, st.SearchStrategy]]] = {
    "diff": (run_diff, {"ops": trace_ops, "target": st.sampled_from(("candidate", "reference", "same")),
                        "html": st.booleans(), "baseline": st.booleans(), "digest": st.booleans()}),
    "inspect": (run_inspect, {"ops": trace_ops, "target": st.sampled_from(("candidate", "reference")),
                              "digest": st.booleans()}),
    "gate": (run_gate, {"content": case_files}),
}


def fuzz_test(name: str, body: Callable[..., None] | None = None) -> Callable[[], None]:
    """Target `name` as a hypothesis test (settings come from the caller); `body` replaces its run
    function, called with the same keyword arguments."""
    run, strategies = TARGETS[name]
    return given(**strategies)(body or run)

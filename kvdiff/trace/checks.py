"""Structural checks of an opened trace: the rules of docs/trace-format.md the reader and the
analysis rely on.

A trace damaged on disk or written by another engine is refused here with one line naming the
object and the rule it breaks (TraceError, exit code 2), instead of failing somewhere in the
analysis. Attributes, ids and positions are read; probe datasets are checked by dtype and shape
only, never loaded. Nothing is unpickled or evaluated: attributes must be plain strings and
numbers, and JSON attributes are parsed as JSON.

Longer than ~300 lines because it is the format's rule book: one checker per kind of object,
read top to bottom beside docs/trace-format.md.
"""

from __future__ import annotations

import json
import posixpath
from pathlib import Path

import h5py
import numpy as np

from kvdiff.errors import TraceError
from kvdiff.trace.points import (FINAL_NORMS, FINAL_POINTS, KNOWN_LAYER_POINTS, KNOWN_POINTS, LAYER_NORMS,
                                  NORM_STATS)
from kvdiff.trace.format import (
    DIGEST_SCHEMA_VERSION, DTYPE_ATTR, FINAL_GROUP, KEY_ROWS_SCHEMA_VERSION, KV_ONLY_SCHEMA_VERSION, ChunkRecord,
    ModelDims, TraceMeta,
)

_REQUIRED = object()
_MAX_INT = 2 ** 62                     # ids, positions and sizes stay far from int64 overflow
# Sane limits, far above any model or run kvdiff can record, refused before any work: a trace's
# numbers size what the analysis allocates and loops over.
MAX_TOKENS = 1 << 20                   # prompt, generated or recorded tokens: 1M (a full capture of 1M tokens
                                       # of a 135M model would be ~800 GB); RoPE diagnoses scan 2x the last position
MAX_TOP_K = 1024                       # top-k entries per step (kvdiff writes 5)
MAX_CELLS = 1 << 26                    # positions x (layers x layer points + final points) the diff compares
                                       # (and report.json holds a number for each): 128k positions x 30 layers x 12 points is 46M
MAX_DIMS = {"num_layers": 10_000, "num_heads": 10_000, "num_kv_heads": 10_000, "head_dim": 1 << 16,
            "hidden_size": 1 << 20, "vocab_size": 1 << 24}
MAX_EXPERTS = 1 << 16                  # num_experts, experts_per_token (optional: 0, a dense model, when absent)
# HDF5's built-in filters and h5py's lzf: any other filter id makes HDF5 look for a plugin library
# on its plugin path, so a trace could make kvdiff load code from outside the file.
_BUILTIN_FILTERS = {h5py.h5z.FILTER_DEFLATE, h5py.h5z.FILTER_SHUFFLE, h5py.h5z.FILTER_FLETCHER32,
                    h5py.h5z.FILTER_SZIP, h5py.h5z.FILTER_NBIT, h5py.h5z.FILTER_SCALEOFFSET, h5py.h5z.FILTER_LZF}
# kvdiff_dtype -> the HDF5 dtype its rows are stored in
_STORED_AS = {"bfloat16": "uint16", "float16": "float16", "float32": "float32", "float64": "float64"}


def malformed(path: Path, problem: str) -> TraceError:
    """The one-line refusal of a trace that breaks the format."""
    return TraceError(f"trace {path} is malformed: {problem}; record it again, or fix its writer "
                      f"(docs/trace-format.md)")


def outside(path: Path, problem: str) -> TraceError:
    """The one-line refusal of a trace that would make kvdiff read something other than the file."""
    return TraceError(f"trace {path} reaches outside its file: {problem}; kvdiff reads nothing but the trace file "
                      f"itself: write every object into it, with no links, external storage, virtual datasets "
                      f"or filter plugins (docs/trace-format.md)")


def _check_storage(path: Path, where: str, ds: h5py.h5d.DatasetID) -> None:
    """A dataset's bytes lie in the file: not external raw storage, not a virtual dataset (a map of
    other files' datasets), not compressed by a filter HDF5 would load as a plugin. (h5py's
    low-level calls: a trace has hundreds of datasets.)"""
    plist = ds.get_create_plist()
    if plist.get_layout() == h5py.h5d.VIRTUAL:
        raise outside(path, f"{where} is a virtual dataset (a map of other files' datasets)")
    if plist.get_external_count():
        files = [_text(plist.get_external(i)[0]) for i in range(plist.get_external_count())]
        raise outside(path, f"{where} keeps its bytes in external file(s) {files}")
    plugins = sorted({plist.get_filter(i)[0] for i in range(plist.get_nfilters())} - _BUILTIN_FILTERS)
    if plugins:
        raise outside(path, f"{where} is compressed with HDF5 filter {plugins[0]}, which HDF5 would load as a "
                            f"plugin (use gzip or lzf)")


def _text(raw: object) -> str:
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


def _check_link(path: Path, f: h5py.File, raw: bytes) -> None:
    """One link of the walk: a hard link, to a dataset whose bytes are in the file if a dataset."""
    where = "/" + _text(raw)
    kind = f.id.links.get_info(raw).type
    if kind == h5py.h5l.TYPE_SOFT:
        raise outside(path, f"{where} is a soft link to {_text(f.id.links.get_val(raw))}")
    if kind == h5py.h5l.TYPE_EXTERNAL:
        filename, target = f.id.links.get_val(raw)
        raise outside(path, f"{where} is an external link to {_text(filename)}:{_text(target)}")
    if kind != h5py.h5l.TYPE_HARD:
        raise outside(path, f"{where} is a user-defined link (type {kind}), which kvdiff does not follow")
    obj = h5py.h5o.open(f.id, raw)
    if isinstance(obj, h5py.h5d.DatasetID):
        _check_storage(path, where, obj)


def check_self_contained(path: Path, f: h5py.File) -> None:
    """Every object of the trace is reached by hard links and stored in the file: external,
    soft and user-defined links, external raw storage, virtual datasets and plugin filters are
    refused (`outside`), before anything but the root attributes is read. Soft links are refused
    too: one pointing into an external link, or aliasing another probe's rows, is never what a
    writer meant. HDF5 visits each group once, so hard links that form a cycle end the walk."""
    def visit(raw: bytes) -> TraceError | None:
        # A refusal is returned, which ends the walk: an exception raised inside HDF5's callback
        # would surface as a SystemError.
        try:
            _check_link(path, f, raw)
        except TraceError as exc:
            return exc
        except (KeyError, OSError, RuntimeError, TypeError, ValueError) as exc:
            return TraceError(f"trace {path} is damaged: HDF5 cannot open /{_text(raw)} ({exc}); record it again")
        return None

    problem = f.id.links.visit(visit)
    if problem is not None:
        raise problem


def read_attr(path: Path, obj: h5py.HLObject, name: str, default: object = _REQUIRED) -> object:
    """An attribute's value (`default` when absent, if given); one HDF5 cannot decode is refused."""
    try:
        if name in obj.attrs:
            return obj.attrs[name]
    except (OSError, TypeError, ValueError) as exc:
        raise malformed(path, f"attribute {name!r} of {obj.name} cannot be read ({exc})") from None
    if default is _REQUIRED:
        raise malformed(path, f"attribute {name!r} of {obj.name} is missing")
    return default


def as_text(path: Path, name: str, value: object) -> str:
    """A string attribute (HDF5 variable- or fixed-length, UTF-8; h5py hands undecodable bytes over
    as lone surrogates)."""
    if not isinstance(value, (bytes, str)):
        raise malformed(path, f"attribute {name!r} must be a string, not {type(value).__name__}")
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value.encode("utf-8"), "utf-8")
    except UnicodeError:
        raise malformed(path, f"attribute {name!r} is not UTF-8 text") from None


def as_int(path: Path, name: str, value: object, low: int = 0, high: int = _MAX_INT) -> int:
    """An integer attribute within [low, high]."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise malformed(path, f"attribute {name!r} must be an integer, not {type(value).__name__}")
    if not low <= int(value) <= high:
        raise malformed(path, f"attribute {name!r} is {int(value)}, outside {low}..{high}")
    return int(value)


def as_float(path: Path, name: str, value: object) -> float:
    """A finite number attribute."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not np.isfinite(value):
        raise malformed(path, f"attribute {name!r} must be a finite number, not {value!r}")
    return float(value)


def as_json(path: Path, name: str, value: object, kind: type) -> list | dict:
    """A JSON attribute whose top-level value is a `kind` (list or dict)."""
    try:
        data = json.loads(as_text(path, name, value))
    except (json.JSONDecodeError, RecursionError) as exc:
        raise malformed(path, f"attribute {name!r} is not valid JSON ({exc})") from None
    if not isinstance(data, kind):
        raise malformed(path, f"attribute {name!r} must be a JSON {kind.__name__}")
    return data


def _check_unicode(path: Path, what: str, text: str) -> None:
    """A string from a JSON attribute is Unicode text: a JSON escape can make a lone surrogate,
    which no UTF-8 output (report.json, a terminal) can hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise malformed(path, f"{what} holds U+{ord(text[exc.start]):04X}, which is not Unicode text") from None


def _check_span(path: Path, what: str, value: object) -> None:
    if not (isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value)
            and 0 <= value[0] <= value[1] < _MAX_INT):
        raise malformed(path, f"{what} must be [first, last] with 0 <= first <= last, not {value!r}")


def parse_messages(path: Path, value: object) -> list[dict]:
    """messages_json: a list of {role, content} strings."""
    messages = as_json(path, "messages_json", value, list)
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise malformed(path, f"message {i} of messages_json must be an object with string role and content")
        for key in ("role", "content"):
            _check_unicode(path, f"message {i} of messages_json {key}", m[key])
    return messages


def parse_chunks(path: Path, value: object, prompt_length: int) -> list[ChunkRecord]:
    """chunks_json: the chunk table, in order, of chunks that lie in the prompt and do not overlap
    (so at most one per prompt token), each encoded at as many positions as it spans."""
    out: list[ChunkRecord] = []
    for i, c in enumerate(as_json(path, "chunks_json", value, list)):
        where = f"chunk {i} of chunks_json"
        if not (isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("hash"), str)):
            raise malformed(path, f"{where} must be an object with string name and hash")
        for key in ("name", "hash"):
            _check_unicode(path, f"{where} {key}", c[key])
        if c.get("cache") not in ("hit", "miss"):
            raise malformed(path, f"{where} has cache {c.get('cache')!r}, not 'hit' or 'miss'")
        for key in ("positions", "encoded_positions"):
            _check_span(path, f"{where} {key}", c.get(key))
        (first, last), (enc_first, enc_last) = c["positions"], c["encoded_positions"]
        if last >= prompt_length:
            raise malformed(path, f"{where} spans positions {first}-{last}, past the prompt's {prompt_length} "
                                  f"tokens: chunks lie in 0..{prompt_length - 1}")
        if out and first <= out[-1].positions[1]:
            raise malformed(path, f"{where} starts at position {first}, not after chunk {i - 1} "
                                  f"({out[-1].positions[0]}-{out[-1].positions[1]}): chunks are in order and do not overlap")
        if enc_last - enc_first != last - first:
            raise malformed(path, f"{where} is encoded at {enc_last - enc_first + 1} positions "
                                  f"({enc_first}-{enc_last}) for its {last - first + 1} ({first}-{last})")
        out.append(ChunkRecord.from_json(c))
    return out


def parse_points(path: Path, value: object) -> tuple[str, ...]:
    """points: known probe point names, each once."""
    points = as_json(path, "points", value, list)
    unknown = [p for p in points if p not in KNOWN_POINTS]
    if unknown:
        raise malformed(path, f"attribute 'points' lists unknown probe point(s) {unknown!r}")
    if len(set(points)) != len(points):
        raise malformed(path, "attribute 'points' lists a probe point twice")
    return tuple(points)


def parse_layers(path: Path, value: object, num_layers: int) -> tuple[int, ...]:
    """layers: increasing layer ids below num_layers."""
    if not (isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu"):
        raise malformed(path, "attribute 'layers' must be a 1-D integer array")
    layers = tuple(int(i) for i in value)
    if any(not 0 <= i < num_layers for i in layers) or any(a >= b for a, b in zip(layers, layers[1:])):
        raise malformed(path, f"attribute 'layers' must be increasing ids in 0..{num_layers - 1}, not {list(layers)}")
    return layers


def _member(path: Path, f: h5py.Group, name: str, kind: type, required: bool = True) -> h5py.HLObject | None:
    """The dataset or group at `name` (None if absent and not required); anything else is refused."""
    obj = f.get(name)
    if obj is None and not required:
        return None
    if not isinstance(obj, kind):
        where = posixpath.join(f.name, name)
        what = "dataset" if kind is h5py.Dataset else "group"
        raise malformed(path, f"{where} is missing" if obj is None else f"{where} is not a {what}")
    return obj


def _dataset(path: Path, f: h5py.Group, name: str) -> h5py.Dataset:
    """The dataset at `name`, its HDF5 type readable as a numpy dtype."""
    ds = _member(path, f, name, h5py.Dataset)
    try:
        ds.dtype
    except (TypeError, ValueError) as exc:
        raise malformed(path, f"the type of {ds.name} cannot be read ({exc})") from None
    return ds


def read_ints(path: Path, f: h5py.Group, name: str, high: int = _MAX_INT) -> np.ndarray:
    """A 1-D integer dataset of at most MAX_TOKENS values in 0..high-1, as int64 (its length is
    checked before it is read: an HDF5 dataset can declare a length its file holds no bytes for)."""
    ds = _dataset(path, f, name)
    if ds.ndim != 1 or ds.dtype.kind not in "iu":
        raise malformed(path, f"{name} must be a 1-D integer dataset, not {ds.shape} {ds.dtype}")
    if ds.shape[0] > MAX_TOKENS:
        raise malformed(path, f"{name} holds {ds.shape[0]} values, more than the {MAX_TOKENS} kvdiff reads")
    values = ds[()]
    if values.size and (int(values.min()) < 0 or int(values.max()) >= high):
        raise malformed(path, f"{name} holds values outside 0..{high - 1}")
    return values.astype(np.int64)


def read_positions(path: Path, f: h5py.Group) -> np.ndarray:
    """/positions: strictly increasing non-negative positions."""
    positions = read_ints(path, f, "positions")
    if positions.size > 1 and not bool(np.all(positions[1:] > positions[:-1])):
        raise malformed(path, "positions must be strictly increasing")
    return positions


def _check_rows(path: Path, ds: h5py.Dataset, row_shape: tuple[int, ...], rows: int) -> None:
    """A probe or statistics dataset: float rows (or bfloat16 coded as uint16) of `row_shape`."""
    captured = read_attr(path, ds, DTYPE_ATTR, str(ds.dtype))
    if not isinstance(captured, str) or _STORED_AS.get(captured) != str(ds.dtype):
        raise malformed(path, f"{ds.name} holds {ds.dtype} rows marked {DTYPE_ATTR}={captured!r}; "
                              f"rows must be float16, float32, float64, or bfloat16 coded as uint16")
    if ds.ndim != 1 + len(row_shape) or ds.shape[1:] != row_shape or ds.shape[0] < rows:
        raise malformed(path, f"{ds.name} has shape {ds.shape}, expected ({rows} or more, "
                              f"{', '.join(map(str, row_shape))}) rows")


def _check_group(path: Path, g: h5py.Group, points: tuple[str, ...], norms: tuple[str, ...],
                 dims: ModelDims, rows: int) -> None:
    """A layer group or the final group: exactly the listed points, and norm statistics."""
    extra = sorted(set(g) - set(points) - {"norm_stats"})
    if extra:
        raise malformed(path, f"{g.name} holds {extra}, which the attribute 'points' does not list")
    for point in points:
        _check_rows(path, _dataset(path, g, point), dims.point_shape(point), rows)
    stats = _member(path, g, "norm_stats", h5py.Group, required=False)
    for norm in stats or ():
        if norm not in norms:
            raise malformed(path, f"{stats.name}/{norm!r} is not a norm of {', '.join(norms)}")
        for stat in _member(path, stats, norm, h5py.Group):
            if stat not in NORM_STATS:
                raise malformed(path, f"{stats.name}/{norm}/{stat!r} is not a norm statistic")
            _check_rows(path, _dataset(path, stats[norm], stat), (), rows)


def _check_steps(path: Path, f: h5py.File, meta: TraceMeta) -> None:
    """steps/: one row per generated token in each field, top-k fields (G, k); step i is numbered i,
    chose generated_ids[i], from the logits of position (prompt length - 1 + i)."""
    _member(path, f, "steps", h5py.Group)
    fields = {name: _dataset(path, f, f"steps/{name}") for name in
              ("step", "position", "token_id", "topk_ids", "topk_values", "margin")}
    count = fields["step"].shape[0] if fields["step"].ndim else -1
    for name, ds in fields.items():
        ndim = 2 if name.startswith("topk") else 1
        kind = "f" if name in ("topk_values", "margin") else "iu"
        if ds.ndim != ndim or ds.shape[0] != count or ds.dtype.kind not in kind:
            raise malformed(path, f"{ds.name} must be {ndim}-D {'float' if kind == 'f' else 'integer'} "
                                  f"with one row per step, not {ds.shape} {ds.dtype}")
    if fields["topk_ids"].shape != fields["topk_values"].shape:
        raise malformed(path, "steps/topk_ids and steps/topk_values differ in shape")
    generated = meta.generated_ids
    if count != generated.size:
        raise malformed(path, f"steps holds {count} rows for the {generated.size} tokens of generated_ids: "
                              "one row per generated token")
    if fields["topk_ids"].shape[1] > min(MAX_TOP_K, MAX_TOKENS * 16 // max(count, 1)):
        raise malformed(path, f"steps/topk_ids holds {fields['topk_ids'].shape[1]} entries for each of {count} steps, "
                              f"more than kvdiff reads (at most {MAX_TOP_K} a step, {MAX_TOKENS * 16} in all)")
    expected = {"step": np.arange(count), "token_id": generated,
                "position": meta.input_ids.size - 1 + np.arange(count)}
    for name, want in expected.items():
        got = read_ints(path, f, f"steps/{name}", high=_MAX_INT) if count else want
        wrong = np.flatnonzero(got != want)
        if wrong.size:
            i = int(wrong[0])
            what = {"step": "count 0, 1, 2, ...", "token_id": "be the tokens of generated_ids",
                    "position": "be the positions whose logits chose the tokens (prompt length - 1 + step)"}[name]
            raise malformed(path, f"steps/{name} must {what}: step {i} holds {int(got[i])}, not {int(want[i])}")


def _check_provenance(path: Path, f: h5py.File, tokens: int) -> None:
    """provenance/ (optional): a string chunk name and integer fields, one row per listed position;
    the listed positions lie in the sequence, each once, in order (they may be positions the trace
    holds no rows for: K/V read from a cache when neither k nor v is recorded)."""
    if _member(path, f, "provenance", h5py.Group, required=False) is None:
        return
    count = _dataset(path, f, "provenance/positions").shape[:1]
    for name in ("positions", "chunk", "prefill_id", "encoded_position", "reused"):
        ds = _dataset(path, f, f"provenance/{name}")
        text = h5py.check_string_dtype(ds.dtype) is not None
        if ds.ndim != 1 or ds.shape != count or text != (name == "chunk") or (not text and ds.dtype.kind not in "biu"):
            raise malformed(path, f"{ds.name} must be a 1-D {'string' if name == 'chunk' else 'integer'} dataset "
                                  f"as long as provenance/positions, not {ds.shape} {ds.dtype}")
    listed = read_ints(path, f, "provenance/positions")
    if listed.size > 1 and not bool(np.all(listed[1:] > listed[:-1])):
        raise malformed(path, "provenance/positions must be strictly increasing")
    if listed.size and listed[-1] >= tokens:
        raise malformed(path, f"provenance/positions holds {int(listed[-1])}, past the last of the sequence's "
                              f"{tokens} tokens")


def _read_expert_groups(path: Path, f: h5py.File, dims: dict) -> None:
    """expert_groups and groups_chosen (DeepSeek's routing): both 0, or groups that split num_experts
    evenly, of which groups_chosen hold at least experts_per_token experts."""
    groups, chosen = (as_int(path, name, read_attr(path, f, name, 0), high=MAX_EXPERTS)
                      for name in ("expert_groups", "groups_chosen"))
    if groups or chosen:
        experts, k = dims["num_experts"], dims["experts_per_token"]
        if not groups or experts % groups or not 0 < chosen <= groups or chosen * (experts // groups) < k:
            raise malformed(path, f"expert_groups {groups} and groups_chosen {chosen} must split num_experts {experts} "
                                  f"evenly and choose groups holding at least experts_per_token {k} experts")
    dims.update(expert_groups=groups, groups_chosen=chosen)


def _read_windows(path: Path, f: h5py.File, num_layers: int) -> tuple[int, ...]:
    """layer_windows: absent (no layer has a sliding window), or one window per layer, 0 for a
    layer attending every earlier position."""
    if "layer_windows" not in f.attrs:
        return ()
    windows = np.asarray(f.attrs["layer_windows"])
    if windows.shape != (num_layers,) or windows.dtype.kind not in "iu" or (windows < 0).any() \
            or (windows > MAX_TOKENS).any():
        raise malformed(path, f"layer_windows must hold one window per layer ({num_layers} integers, 0 for a global "
                              f"layer), each at most {MAX_TOKENS}")
    return tuple(int(w) for w in windows)


def read_meta(path: Path, f: h5py.File) -> TraceMeta:
    """The root attributes and the id datasets, each checked for its type and range."""
    attr = lambda name: read_attr(path, f, name)
    dims = {name: as_int(path, name, attr(name), low=1, high=high) for name, high in MAX_DIMS.items()}
    if dims["num_heads"] % dims["num_kv_heads"]:
        raise malformed(path, f"num_heads {dims['num_heads']} is not a multiple of num_kv_heads {dims['num_kv_heads']}")
    if dims["head_dim"] % 2:
        raise malformed(path, f"head_dim {dims['head_dim']} is odd (RoPE rotates pairs of elements)")
    for name in ("num_experts", "experts_per_token"):
        dims[name] = as_int(path, name, read_attr(path, f, name, 0), high=MAX_EXPERTS)
    dims["post_norms"] = as_int(path, "post_norms", read_attr(path, f, "post_norms", 0), high=1)
    dims["sinks"] = as_int(path, "sinks", read_attr(path, f, "sinks", 0), high=1)
    for name in ("latent_dim", "rope_dim"):
        dims[name] = as_int(path, name, read_attr(path, f, name, 0), high=MAX_DIMS["hidden_size"])
    if dims["experts_per_token"] > dims["num_experts"]:
        raise malformed(path, f"experts_per_token {dims['experts_per_token']} exceeds num_experts {dims['num_experts']}")
    _read_expert_groups(path, f, dims)
    dims["layer_windows"] = _read_windows(path, f, dims["num_layers"])
    texts = {name: as_text(path, name, attr(name)) for name in TraceMeta.SCALARS}
    schema = as_int(path, "schema_version", attr("schema_version"), low=1)
    input_ids = read_ints(path, f, "input_ids", dims["vocab_size"])
    points = parse_points(path, attr("points"))
    model = ModelDims(**dims, attn_scale=as_float(path, "attn_scale", attr("attn_scale")))
    foreign = [p for p in points if p not in model.points()]
    if foreign:
        raise malformed(path, f"attribute 'points' lists {', '.join(foreign)}, which a model of num_experts "
                              f"{model.num_experts} and post_norms {model.post_norms} does not have")
    return TraceMeta(
        **texts, dims=model,
        messages=parse_messages(path, attr("messages_json")),
        chunks=parse_chunks(path, attr("chunks_json"), input_ids.size),
        input_ids=input_ids,
        generated_ids=read_ints(path, f, "generated_ids", dims["vocab_size"]),
        points=points,
        layers=parse_layers(path, attr("layers"), dims["num_layers"]),
        schema_version=schema, kv_only_positions=_read_kv_only(path, f, schema),
        key_only_positions=_read_key_only(path, f, schema), **_digest_meta(path, f, schema, dims))


def _digest_meta(path: Path, f: h5py.File, schema: int, dims: dict) -> dict:
    """trace_mode, digest_points and digest_layers: a digest trace's (schema 3), else none."""
    mode = read_attr(path, f, "trace_mode", "full")
    if mode not in ("full", "digest") or (mode == "digest") != (schema >= DIGEST_SCHEMA_VERSION):
        raise malformed(path, f"trace_mode {mode!r} with schema {schema}: digest traces are of schema "
                              f"{DIGEST_SCHEMA_VERSION} or {KEY_ROWS_SCHEMA_VERSION}, full ones of 1 or 2")
    if mode == "full":
        return {}
    return {"trace_mode": mode, "digest_points": parse_points(path, read_attr(path, f, "digest_points")),
            "digest_layers": parse_layers(path, read_attr(path, f, "digest_layers"), dims["num_layers"])}


def _read_kv_only(path: Path, f: h5py.File, schema: int) -> np.ndarray:
    """/kv_only_positions: present in a trace of schema 2, allowed from it on."""
    return _read_listed(path, f, "kv_only_positions", schema == KV_ONLY_SCHEMA_VERSION,
                        schema >= KV_ONLY_SCHEMA_VERSION, KV_ONLY_SCHEMA_VERSION)


def _read_key_only(path: Path, f: h5py.File, schema: int) -> np.ndarray:
    """/key_only_positions: present exactly in a trace of schema 4."""
    return _read_listed(path, f, "key_only_positions", schema == KEY_ROWS_SCHEMA_VERSION,
                        schema == KEY_ROWS_SCHEMA_VERSION, KEY_ROWS_SCHEMA_VERSION)


def _read_listed(path: Path, f: h5py.File, name: str, required: bool, allowed: bool, schema: int) -> np.ndarray:
    """A strictly increasing list of positions, required or allowed by the trace's schema (`schema`:
    the one that introduced it), else empty."""
    if name not in f:
        if required:
            raise malformed(path, f"a trace of schema {schema} must hold {name}")
        return np.zeros(0, dtype=np.int64)
    if not allowed:
        raise malformed(path, f"{name} needs schema {schema}, not {int(f.attrs['schema_version'])}: a reader of that "
                              "schema would take its missing rows for data")
    listed = read_ints(path, f, name)
    if listed.size > 1 and not bool(np.all(listed[1:] > listed[:-1])):
        raise malformed(path, f"{name} must be strictly increasing")
    return listed


def check_layout(path: Path, f: h5py.File, meta: TraceMeta, positions: np.ndarray) -> None:
    """Every probe, statistics, weight, step and provenance dataset has the place, dtype and shape
    the format gives it, and the tables agree with the token lists: a step per generated token,
    positions (and provenance) within the prompt and generated tokens."""
    _check_steps(path, f, meta)          # first: they say how many tokens the run generated
    rows = int(positions[-1]) + 1 if positions.size else 0
    tokens = meta.input_ids.size + meta.generated_ids.size
    if rows > tokens:
        raise malformed(path, f"positions holds {rows - 1}, past the last of the {meta.input_ids.size} prompt and "
                              f"{meta.generated_ids.size} generated tokens (positions lie in 0..{tokens - 1})")
    cells = positions.size * (len(meta.layers) * sum(p in KNOWN_LAYER_POINTS for p in meta.points)
                              + sum(p in FINAL_POINTS for p in meta.points))
    if cells > MAX_CELLS:
        raise TraceError(f"trace {path} is too large to diff: {positions.size} positions x its layers and points are "
                         f"{cells} rows to compare, more than the {MAX_CELLS} kvdiff compares; record fewer "
                         f"(--layers, --capture)")
    if meta.trace_mode == "full" and np.setdiff1d(meta.kv_only_positions, positions).size:
        raise malformed(path, "kv_only_positions holds positions that /positions does not")
    if np.setdiff1d(meta.key_only_positions, positions).size or np.intersect1d(meta.key_only_positions,
                                                                               meta.kv_only_positions).size:
        raise malformed(path, "key_only_positions holds positions that /positions does not, or K/V-only ones")
    layers = meta.layers
    dims = meta.dims
    layer_points = tuple(p for p in meta.points if p in KNOWN_LAYER_POINTS)
    final_points = tuple(p for p in meta.points if p in FINAL_POINTS)
    groups = _member(path, f, "layers", h5py.Group, required=False)
    stray = sorted(set(groups or ()) - {str(i) for i in layers})
    if stray:
        raise malformed(path, f"layers/ holds {stray}, which the attribute 'layers' does not list")
    for i in layers if layer_points else ():
        _check_group(path, _member(path, f, f"layers/{i}", h5py.Group), layer_points, LAYER_NORMS, dims, rows)
    final = _member(path, f, FINAL_GROUP, h5py.Group, required=bool(final_points))
    if final is not None:
        _check_group(path, final, final_points, FINAL_NORMS, dims, rows)
    _check_provenance(path, f, tokens)

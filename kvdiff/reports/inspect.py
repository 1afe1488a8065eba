"""What a trace holds, as rich renderables: model, chunks, tokens, points, layers and sizes."""

from __future__ import annotations

from collections import defaultdict

from rich.console import Group
from rich.table import Table
from rich.text import Text

from kvdiff.trace.format import DIGEST_GROUP
from kvdiff.trace.points import POINT_ORDER
from kvdiff.trace.ranges import format_ranges
from kvdiff.trace.reader import DatasetInfo, TraceReader
from kvdiff.reports.printable import printable


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def _what_is_recorded(tr: TraceReader, datasets: list[DatasetInfo]) -> list[tuple[str, str]]:
    """Summary rows of what the trace holds: the points and layers of a full trace; a digest
    trace's digests (every row; their size from `datasets`, the trace's) and its zoom window (full rows)."""
    m = tr.meta
    if m.trace_mode != "digest":
        return [("points", ", ".join(m.points)), ("layers", format_ranges(m.layers))]
    digests = sum(ds.stored_bytes for ds in datasets if ds.name.startswith(DIGEST_GROUP + "/"))
    window = (f"full rows of {', '.join(m.points)}; layers {format_ranges(m.layers)}, positions "
              f"{format_ranges(tr.positions)}") if tr.positions.size and m.points else "none (digests only)"
    return [("mode", "digest: a hash, rms and max_abs of every row; full rows only in the window"),
            ("digests", f"{', '.join(m.digest_points)}; layers {format_ranges(m.digest_layers)}, positions "
                        f"{format_ranges(tr.digest_positions)} ({_mb(digests)})"),
            ("window", window)]


def describe_trace(tr: TraceReader) -> Group:
    """A summary table, the chunk table and the stored size per probe point (a digest trace's:
    of its window's full rows)."""
    m = tr.meta
    datasets = tr.datasets()         # one walk of the file for the summary and the size table
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    rows = [
        ("trace", f"{tr.path} ({_mb(tr.nbytes)}, schema {m.schema_version}, kvdiff {m.kvdiff_version})"),
        ("model", f"{m.model_name}  {m.model_fingerprint}"),
        ("shape", f"{m.dims.num_layers} layers, {m.dims.num_heads} heads, {m.dims.num_kv_heads} kv heads, "
                  f"head_dim {m.dims.head_dim}, hidden {m.dims.hidden_size}, vocab {m.dims.vocab_size}"),
        ("run", f"strategy {m.strategy}, numerics {m.numerics}, {m.dtype} on {m.device}, "
                f"torch {m.torch_version}, transformers {m.transformers_version}"),
        ("tokens", f"{len(m.input_ids)} prompt + {len(m.generated_ids)} generated; positions "
                   f"{format_ranges(tr.digest_positions if m.trace_mode == 'digest' else tr.positions)}"),
        *([("kv only", f"positions {format_ranges(m.kv_only_positions)}: K/V read from the cache, "
                       "only k and v recorded")] if m.kv_only_positions.size else []),
        *([("key rows", f"positions {format_ranges(m.key_only_positions)}: only k and v kept in full, the keys "
                        "attention read at the window's rows")] if m.key_only_positions.size else []),
        ("text", repr(m.text)),
        *_what_is_recorded(tr, datasets),
    ]
    for key, value in rows:
        summary.add_row(key, Text(printable(value, keep="")))         # trace text is never read as markup
    parts = [summary]
    if m.chunks:
        chunks = Table(title="chunks", title_justify="left")
        for col in ("name", "positions", "encoded at", "cache", "hash"):
            chunks.add_column(col)
        for c in m.chunks:
            chunks.add_row(Text(printable(c.name, keep="")), f"{c.positions[0]}-{c.positions[1]}",
                           f"{c.encoded_positions[0]}-{c.encoded_positions[1]}", c.cache, Text(printable(c.hash[:16], keep="")))
        parts.append(chunks)
    sizes: dict[str, list] = defaultdict(lambda: [0, 0, None, ""])
    for ds in datasets:
        head = ds.name.split("/")
        if head[0] in ("layers", "final") and len(head) == (3 if head[0] == "layers" else 2):
            entry = sizes[head[-1]]
            entry[0] += 1
            entry[1] += ds.stored_bytes
            entry[2], entry[3] = ds.shape[1:], ds.dtype
    points = Table(title="window rows" if m.trace_mode == "digest" else "probe points", title_justify="left")
    for col in ("point", "datasets", "row shape", "dtype", "stored"):
        points.add_column(col, justify="right" if col in ("datasets", "stored") else "left")
    for name, (count, stored, shape, dtype) in sorted(sizes.items(), key=lambda kv: POINT_ORDER[kv[0]]):
        points.add_row(name, str(count), str(tuple(shape)), dtype, _mb(stored))
    parts.append(points)
    return Group(*parts)

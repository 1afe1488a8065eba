"""The recorder's digest side: every capture's rows hashed where they are (trace/digest.py) and
the digests handed to the writer, a row of every layer's points per position in each of its
tables (format.digest_tables); what a digest trace records outside its zoom window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvdiff.trace.digest import DIGEST_STATS, DigestBatch, row_digests
from kvdiff.trace.format import digest_path, digest_table_of, digest_tables
from kvdiff.trace.sink import ProbeIntegrityError
from kvdiff.trace.staging import version_of
from kvdiff.trace.writer import TraceWriter

# Captures of at least this many elements (a prefill's) are hashed as they come: on a GPU copied
# into a stage of their row width and hashed a stage at a time (DigestBatch.stage), elsewhere at
# once (the hash costs about what reading the rows costs). Smaller ones wait for the end of the
# forward by reference and go together.
HASH_AT_ONCE_ELEMENTS = 1 << 16
STAGED_DEVICES = ("cuda",)      # where a copy and a share of one launch cost less than a launch of its own
PENDING_ROWS = 256      # rows of repeated decode steps whose digests are held before one write per table


@dataclass(frozen=True)
class _RepeatPlan:
    """How a one-position forward's digests become its tables' rows: where each cell of the
    tables, laid end to end, is among the captures' digests (a cell that does not fire points
    past them, at an empty digest); for captures hashed here, how they are grouped (one size,
    dtype and device a group; concatenated a part at a time, one shape and strides a part)."""

    keys: list[tuple[str, int | None]]
    groups: list[list[list[int]]]               # empty for digests taken where the captures ran
    order: torch.Tensor
    empty: tuple[torch.Tensor, torch.Tensor]    # the empty digest (a zero hash, NaN statistics), on the device


def changed_in_place(point: str, layer: int | None) -> ProbeIntegrityError:
    """The error for a capture the model changed in place before its forward ended, after a
    forward where it did not, so that it was kept by reference: its digest would not be of the
    rows the model computed."""
    return ProbeIntegrityError(f"the model changed the captured rows of {point!r} at layer {layer} in place before "
                               "its forward ended, after a forward where it did not: the trace was dropped; leave "
                               "that point out of the capture to record this model")


def _stacked(parts: list[list[torch.Tensor]]) -> torch.Tensor:
    """Captures of one row each, of one size, as the rows of one tensor, a part (one shape and
    strides) at a time: concatenating captures as they are is one fast copy where a reshape each
    costs more than the concatenation, and mixing strides in one concatenation is 5x slower."""
    joined = []
    for rows in parts:
        try:
            joined.append(torch.cat(rows).view(len(rows), -1))
        except RuntimeError:        # the shapes changed since the plan (the sizes did not)
            joined.append(torch.cat([r.reshape(-1) for r in rows]).view(len(rows), -1))
    return joined[0] if len(joined) == 1 else torch.cat(joined)


class DigestTaker:
    """Hashes the captures of each forward and writes their digests: `take` per capture,
    `end_forward` once the forward is over (before the writer commits it). A point of a table
    that did not fire in a forward has a zero hash and NaN statistics in its row."""

    def __init__(self, writer: TraceWriter, points: Sequence[str], layers: Sequence[int]):
        """Digests of `points` at `layers` (in the order of the tables' layer axis) and of the
        final points among `points`."""
        self.writer = writer
        # (final, table name) -> the layers of its layer axis ([None] for the final points) and its columns
        # (format.digest_tables)
        self._tables: dict[tuple[bool, str], tuple[list[int | None], tuple[str, ...]]] = {
            (False, table): (list(layers), columns)
            for table, columns in (digest_tables(tuple(points), layers[0]) if layers else {}).items()}
        self._tables.update(((True, table), ([None], columns))
                            for table, columns in digest_tables(tuple(points), None).items())
        # each table's hash and stats datasets, its cells' slice of the tables laid end to end, its row shape
        self._layout: list[tuple[str, str, slice, tuple[int, ...]]] = []
        cells = 0
        for (final, table), (layers, columns) in self._tables.items():
            shape = (len(columns),) if final else (len(layers), len(columns))
            self._layout.append((digest_path(final, table, "hash"), digest_path(final, table, "stats"),
                                 slice(cells, cells + len(layers) * len(columns)), shape))
            cells += len(layers) * len(columns)
        self._batch = DigestBatch()
        self._taken: dict[tuple[int | None, str], dict[str, tuple | int]] = {}
        self._positions: np.ndarray | None = None
        # Small captures wait for the end of the forward by reference, as the writer's stage keeps
        # them: a capture's first one is cloned and watched, and those the model changed in place
        # before the forward ended are cloned from then on.
        self._seen: set[tuple[str, int | None]] = set()
        self._cloned: set[tuple[str, int | None]] = set()
        self._watched: list[tuple[str, int | None, torch.Tensor, int, bool]] = []
        self._plan: _RepeatPlan | None = None           # of the captures take_repeat hashes
        self._taken_plan: _RepeatPlan | None = None     # of the digests take_digested is handed
        # forwards' digests not yet written: their positions, hashes and statistics in `_pending_plan`'s order
        self._pending: list[tuple[np.ndarray, torch.Tensor, torch.Tensor]] = []
        self._pending_rows = 0
        self._pending_plan: _RepeatPlan | None = None

    @property
    def keeps_by_reference(self) -> bool:
        """Whether captures may wait for the end of their forward by reference: no point was
        seen changed in place before its forward ended."""
        return not self._cloned

    def take(self, point: str, layer: int | None, rows: torch.Tensor, positions: np.ndarray) -> None:
        """Digest `rows` (one row per position, any trailing shape) of `point` at `layer`; every
        capture of a forward is at the same positions."""
        self._positions = positions
        if rows.dim() != 2 or rows.shape[0] != positions.size:     # a reshape costs a few us; a forward has hundreds
            rows = rows.reshape(positions.size, -1)
        taken = self._taken.setdefault((layer, digest_table_of(point)), {})
        if rows.numel() >= HASH_AT_ONCE_ELEMENTS:
            staged = self._batch.stage(rows) if rows.device.type in STAGED_DEVICES else None
            taken[point] = row_digests(rows) if staged is None else staged
            return
        key, version = (point, layer), version_of(rows)
        learning = key not in self._seen
        if version is not None and key not in self._cloned:
            self._watched.append((point, layer, rows, version, learning))
        if learning or version is None or key in self._cloned:
            self._seen.add(key)
            rows = rows.clone()
        taken[point] = self._batch.add(rows)

    def take_repeat(self, keys: list[tuple[str, int | None]], rows: list[torch.Tensor], position: int) -> bool:
        """Digest a one-position forward's captures (`keys` and their `rows`, every digested point
        once, in firing order) in one go: a decode step. Its digests are written with the next
        steps'. False, with nothing taken, where the captures span devices: `take` each instead."""
        plan = self._plan
        if plan is None or plan.keys != keys:
            plan = self._plan = self._plan_for(keys, rows)
            if plan is None:
                return False
        digests = [row_digests(_stacked([[rows[i] for i in part] for part in parts])) for parts in plan.groups]
        hashes, stats = zip(*digests)
        hashes, stats = ((torch.cat(d) if len(d) > 1 else d[0]).unsqueeze(0) for d in (hashes, stats))
        self._hold(plan, np.array([position], dtype=np.int64), hashes, stats)
        return True

    def take_digested(self, keys: list[tuple[str, int | None]], hashes: torch.Tensor, stats: torch.Tensor,
                      positions: np.ndarray) -> None:
        """A forward's digests, taken where its captures ran (together, or inside a CUDA graph's
        step): `hashes` (T, n) and `stats` (T, n, 2) of `keys` (every digested point once) at its
        T increasing `positions`, copied here (a graph rewrites them at its next replay). A decode
        step's are written with the next steps'."""
        plan = self._taken_plan
        if plan is None or (plan.keys is not keys and plan.keys != keys):
            plan = self._taken_plan = self._planned(keys, [], list(range(len(keys))), hashes.device)
        self._hold(plan, positions, hashes.clone(), stats.clone())

    def _hold(self, plan: _RepeatPlan, positions: np.ndarray, hashes: torch.Tensor, stats: torch.Tensor) -> None:
        """Keep a forward's digests, in `plan`'s order, until `flush` makes them its tables' rows
        (for all the held forwards at once: decode steps, PENDING_ROWS of them)."""
        if self._pending and (plan is not self._pending_plan or positions[0] <= self._pending[-1][0][-1]):
            self.flush()        # one write holds increasing positions: a later row still replaces an earlier one
        self._pending_plan = plan
        self._pending.append((positions, hashes, stats))
        self._pending_rows += positions.size
        if self._pending_rows >= PENDING_ROWS:
            self.flush()

    def _plan_for(self, keys: list[tuple[str, int | None]], rows: list[torch.Tensor]) -> _RepeatPlan | None:
        groups: dict[tuple[int, torch.dtype, torch.device], dict[tuple, list[int]]] = {}
        for i, r in enumerate(rows):
            groups.setdefault((r.numel(), r.dtype, r.device), {}).setdefault((r.shape, r.stride()), []).append(i)
        if len({device for _, _, device in groups}) > 1:
            return None
        members = [list(parts.values()) for parts in groups.values()]
        hashed = [i for parts in members for part in parts for i in part]
        return self._planned(list(keys), members, hashed, rows[0].device)

    def _planned(self, keys: list[tuple[str, int | None]], groups: list[list[list[int]]], hashed: list[int],
                 device: torch.device) -> _RepeatPlan:
        """The plan of digests of `keys[i]` for i in `hashed`, laid end to end in that order."""
        at = {i: n for n, i in enumerate(hashed)}
        where = {key: at[i] for i, key in enumerate(keys)}
        order = [where.get((point, layer), len(keys)) for layers, columns in self._tables.values()
                 for layer in layers for point in columns]
        empty = (torch.zeros(1, dtype=torch.int64, device=device),
                 torch.full((1, len(DIGEST_STATS)), float("nan"), device=device))
        return _RepeatPlan(keys, groups, torch.tensor(order, device=device), empty)

    def flush(self) -> None:
        """Write the held forwards' digests: one write of each table for all of them."""
        if not self._pending:
            return
        positions = np.concatenate([p for p, _, _ in self._pending])
        empty = self._pending_plan.empty
        rows = positions.size
        hashes = torch.cat([torch.cat([h for _, h, _ in self._pending]), empty[0].expand(rows, 1)], 1)
        stats = torch.cat([torch.cat([s for _, _, s in self._pending]), empty[1].expand(rows, 1, -1)], 1)
        order = self._pending_plan.order
        hashes, stats = hashes.index_select(1, order), stats.index_select(1, order)
        self._pending, self._pending_rows = [], 0
        for hash_path, stats_path, columns, shape in self._layout:
            h, s = hashes[:, columns].view(-1, *shape), stats[:, columns].view(-1, *shape, len(DIGEST_STATS))
            self.writer.write_rows_at(hash_path, positions, h, tuple(h.shape))
            self.writer.write_rows_at(stats_path, positions, s, tuple(s.shape))

    def end_forward(self) -> None:
        """Hash the forward's small captures together and write each layer's digests."""
        self.flush()
        if not self._taken:
            return
        for point, layer, rows, version, learning in self._watched:
            if rows._version == version:
                continue
            if not learning:
                raise changed_in_place(point, layer)
            self._cloned.add((point, layer))
        self._watched = []
        batched = self._batch.digests() if len(self._batch) else []
        for (final, table), (layers, columns) in self._tables.items():
            fired = {(layer, point): batched[d] if isinstance(d, int) else d
                     for layer in layers for point, d in self._taken.get((layer, table), {}).items()}
            if fired:
                self._write_table(final, table, layers, columns, fired)
        self._taken = {}
        self._positions = None

    def _write_table(self, final: bool, table: str, layers: list[int | None], columns: tuple[str, ...],
                     fired: dict[tuple[int | None, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One forward's rows of a digest table: (positions, layers, columns) ((positions,
        columns) for the final points), a cell that did not fire at an empty digest."""
        n = self._positions.size
        # A model split across GPUs hands a layer's input over on the previous layer's GPU: a
        # table's digests (a few numbers a row) meet on its first capture's device.
        device = next(iter(fired.values()))[0].device
        cells = [(layer, point) for layer in layers for point in columns]
        if len(fired) == len(cells):          # every cell fired: one stack each
            digests = [fired[c] for c in cells]
            if any(h.device != device for h, _ in digests):
                digests = [(h.to(device), s.to(device)) for h, s in digests]
            hashes = torch.stack([h for h, _ in digests], 1)
            stats = torch.stack([s for _, s in digests], 1)
        else:
            hashes = torch.zeros(n, len(cells), dtype=torch.int64, device=device)
            stats = torch.full((n, len(cells), len(DIGEST_STATS)), float("nan"), device=device)
            at = {c: i for i, c in enumerate(cells)}
            for cell, (h, s) in fired.items():
                hashes[:, at[cell]] = h.to(device)
                stats[:, at[cell]] = s.to(device)
        shape = (n, len(columns)) if final else (n, len(layers), len(columns))
        self.writer.write_rows_at(digest_path(final, table, "hash"), self._positions, hashes.view(shape), shape)
        self.writer.write_rows_at(digest_path(final, table, "stats"), self._positions,
                                  stats.view(*shape, len(DIGEST_STATS)), (*shape, len(DIGEST_STATS)))

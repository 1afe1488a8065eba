"""StepBatch: staged forwards written to the trace file, decode steps several at a time.

A decode step hands the writer thread one staged forward of a single position: a few hundred
captures of one row each. Writing each row costs a file call per dataset and step, and that
thread shares the interpreter with the model's forward. So the writer thread keeps up to
`max_steps` consecutive one-position forwards of the same layout and writes them together: one
call per dataset for all of them, and one batch of norm statistics. Anything else (a prefill,
a changed layout, a gap in positions) first writes what is kept, then is written at once.

Only the writer thread uses a StepBatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvdiff.trace.norm_stats import norm_statistics
from kvdiff.trace.points import NORM_STATS
from kvdiff.trace.staging import SealedStage, StageLayout
from kvdiff.trace.file import TraceFile
from kvdiff.trace.format import from_storage, to_storage

DEFAULT_MAX_STEPS = 32


@dataclass(frozen=True)
class StagedForward:
    """The captures of one forward (or of a full stage), as staged by TraceWriter."""

    rows: list[tuple[str, np.ndarray, int]]           # dataset name, positions, index in the stage
    norms: list[tuple[str, np.ndarray, int, int]]     # statistics group, positions, input and output index
    sealed: SealedStage
    layout: StageLayout | None = None     # set when it repeats a layout (Stage.repeat) ...
    position: int | None = None           # ... with every capture at this one position


def _one_position(fwd: StagedForward) -> int | None:
    """The position every capture of `fwd` holds, when they all hold the same single one."""
    entries = [pos for _, pos, _ in fwd.rows] + [pos for _, pos, _, _ in fwd.norms]
    if entries and all(pos is entries[0] for pos in entries):     # the recorder's: one array for all
        return int(entries[0][0]) if entries[0].size == 1 else None
    if not entries or any(pos.size != 1 for pos in entries):
        return None
    first = int(entries[0][0])
    return first if all(int(pos[0]) == first for pos in entries) else None


def put_norm_stats(file: TraceFile, name: str, positions: np.ndarray, stats: torch.Tensor) -> None:
    """Statistics (S, T) of one norm, one row per NORM_STATS name, at `positions`."""
    for stat, row in zip(NORM_STATS, stats.numpy()):
        file.put(f"{name}/{stat}", positions, row, "float64")


def _write(file: TraceFile, fwd: StagedForward, stored: list[tuple[np.ndarray, str]],
           positions: np.ndarray | None = None) -> None:
    """Write the rows and the norms' statistics of `fwd` (at `positions` when given, for every capture)."""
    for name, pos, i in fwd.rows:
        file.put(name, pos if positions is None else positions, *stored[i])
    by_width: dict[tuple[int, int], list[int]] = {}
    for n, (_, _, x, y) in enumerate(fwd.norms):
        by_width.setdefault((stored[x][0].shape[-1], stored[y][0].shape[-1]), []).append(n)
    for members in by_width.values():
        xs = torch.cat([_tensor(stored[fwd.norms[n][2]]) for n in members])      # norm_statistics widens to fp64
        ys = torch.cat([_tensor(stored[fwd.norms[n][3]]) for n in members])
        counts = [stored[fwd.norms[n][2]][0].shape[0] for n in members]
        for n, stats in zip(members, norm_statistics(xs, ys).split(counts, dim=1)):
            name, pos = fwd.norms[n][0], fwd.norms[n][1]
            put_norm_stats(file, name, pos if positions is None else positions, stats)


def _tensor(stored: tuple[np.ndarray, str]) -> torch.Tensor:
    """Stored rows as a float tensor (bfloat16 widened exactly), one row per position."""
    rows = torch.from_numpy(from_storage(*stored))
    return rows.reshape(-1, rows.shape[-1])


def _stacked(steps: list[SealedStage]) -> list[tuple[np.ndarray, str]]:
    """Each capture's rows over `steps` (sealed stages of one layout, one row each), stacked: one
    array copy per flattened part for all the steps, then a view per capture."""
    out: list[tuple[np.ndarray, str] | None] = [None] * steps[0].count
    for j, part in enumerate(steps[0].parts):
        flats = [to_storage(step.parts[j].host.ready()) for step in steps]
        block, dtype = np.stack([flat for flat, _ in flats]), flats[0][1]
        for i, shape, span in part.spans():
            out[i] = block[:, span].reshape(len(steps) * shape[0], *shape[1:]), dtype
    steps[0].fill_same(out, len(steps))
    return out


class StepBatch:
    """Writes staged forwards to `file`, keeping up to `max_steps` one-position forwards to write together."""

    def __init__(self, file: TraceFile, max_steps: int = DEFAULT_MAX_STEPS):
        self.file = file
        self.max_steps = max_steps
        self._kept: list[SealedStage] = []
        self._layout: StagedForward | None = None
        self._signature: tuple | None = None
        self._first = 0

    def add(self, fwd: StagedForward) -> None:
        """Write `fwd` now, or keep it to write with the next steps (its rows are read then)."""
        if fwd.layout is not None:          # a repeated layout: compared by identity, and how it was flattened
            position, signature = fwd.position, (fwd.layout, [part.members for part in fwd.sealed.parts],
                                                 fwd.sealed.same)
        else:
            position = _one_position(fwd)
            if position is None:
                self.flush()
                _write(self.file, fwd, fwd.sealed.stored())
                return
            signature = ([(name, i) for name, _, i in fwd.rows], [(name, x, y) for name, _, x, y in fwd.norms],
                         [(part.members, part.shapes) for part in fwd.sealed.parts], fwd.sealed.same)
        if self._kept and (signature != self._signature or position != self._first + len(self._kept)):
            self.flush()
        if not self._kept:
            self._layout, self._signature, self._first = fwd, signature, position
        self._kept.append(fwd.sealed)
        if len(self._kept) >= self.max_steps:
            self.flush()

    def flush(self) -> None:
        """Write the kept steps."""
        if not self._kept:
            return
        kept, layout = self._kept, self._layout
        self._kept, self._layout, self._signature = [], None, None
        positions = np.arange(self._first, self._first + len(kept), dtype=np.int64)
        _write(self.file, layout, _stacked(kept), positions)

    def discard(self) -> None:
        """Drop the kept steps."""
        self._kept, self._layout, self._signature = [], None, None

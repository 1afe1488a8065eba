"""Host copies of captured rows, made when the rows are handed over.

A decode step hands over hundreds of small captures, and on a GPU each torch call costs tens of
microseconds of host time. Small captures therefore go into a `Stage` and are copied to host
memory together when it is sealed (at the end of each forward): one flattened, pinned,
asynchronous copy per device and dtype. Until then a staged capture is either kept by
reference, when its tensor has a version counter that shows whether anything changed it in
place before the seal (`Stage.changed`), or cloned where it lives (inference tensors have no
version counter). Large captures get a `HostRows` copy of their own at once.

Decode steps repeat one layout: a `StageLayout` keeps what a stage held apart from the tensors,
and `Stage.repeat` stages a later forward's captures, handed over as one list, in that layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from kvdiff.trace.format import to_storage

STAGE_BYTES = 4 << 20       # a stage is sealed once it holds this much
STAGED_ROWS_BYTES = 1 << 20  # captures up to this size are staged, larger ones copied alone


def _copied_event(device: torch.device) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def version_of(rows: torch.Tensor) -> int | None:
    """`rows`' version counter; None for an inference tensor, which has none (and which nothing
    outside inference mode can change in place)."""
    return None if rows.is_inference() else rows._version   # asking costs ~0.1 us, the error ~6 us


@dataclass(frozen=True)
class HostRows:
    """A private host copy of captured rows. From CUDA the copy runs asynchronously into pinned
    memory until `copied` completes; `ready()` waits for it."""

    tensor: torch.Tensor
    copied: torch.cuda.Event | None = None

    def ready(self) -> torch.Tensor:
        if self.copied is not None:
            self.copied.synchronize()
        return self.tensor


def host_copy(rows: torch.Tensor) -> HostRows:
    """Copy `rows` now, so that a buffer overwritten later cannot change what is written."""
    rows = rows.detach()
    if rows.is_cuda:
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        return HostRows(host, _copied_event(rows.device))
    return HostRows(rows.to("cpu", copy=True, memory_format=torch.contiguous_format))


@dataclass
class FlatCopy:
    """Staged rows of one device and dtype, flattened into one host copy."""

    members: list[int]
    shapes: list[tuple[int, ...]]
    host: HostRows

    def spans(self) -> Iterator[tuple[int, tuple[int, ...], slice]]:
        """(capture index, stored shape, its elements of the flattened copy) for each member."""
        start = 0
        for i, shape in zip(self.members, self.shapes):
            n = math.prod(shape)
            yield i, shape, slice(start, start + n)
            start += n


@dataclass
class SealedStage:
    """The host side of a sealed stage: `stored()` waits for the copies and gives each capture's rows."""

    count: int
    parts: list[FlatCopy]
    same: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)   # a capture of a tensor captured
                                                                                # earlier: that index, stored shape

    def stored(self) -> list[tuple[np.ndarray, str]]:
        """Each capture's rows as stored in a trace (trace_format.to_storage), once its copy has
        arrived; sliced with numpy, so the writer thread makes no torch call per capture."""
        out: list[tuple[np.ndarray, str] | None] = [None] * self.count
        for part in self.parts:
            flat, dtype = to_storage(part.host.ready())
            for i, shape, span in part.spans():
                out[i] = flat[span].reshape(shape), dtype
        self.fill_same(out)
        return out

    def fill_same(self, out: list, steps: int = 1) -> None:
        """Give each capture in `same` the rows of the earlier capture of its tensor (of `steps`
        stacked steps)."""
        for i, (j, shape) in self.same.items():
            out[i] = out[j][0].reshape(steps * shape[0], *shape[1:]), out[j][1]


@dataclass(eq=False)
class StageLayout:
    """A stage without its tensors: what each capture is stored as and what the writer makes of
    it. Compared by identity: one object stands for one layout for as long as it repeats."""

    shapes: list[tuple[int, ...]]
    numels: list[int]
    rows: list[tuple[str, int]]                 # dataset, index
    norms: list[tuple[str, int, int]]           # statistics group, input and output index
    nbytes: int


@dataclass
class Stage:
    """Small captures of one forward and what the writer will make of them: rows of a dataset,
    or a norm's input and output."""

    captured: list[torch.Tensor] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)      # the shape each is stored with
    versions: list[int | None] = field(default_factory=list)         # a reference's version when added; None: a clone
    watched: list[tuple[int, torch.Tensor, int]] = field(default_factory=list)   # cloned, original, its version
    nbytes: int = 0
    rows: list[tuple[str, np.ndarray, int]] = field(default_factory=list)         # dataset, positions, index
    norms: list[tuple[str, np.ndarray, int, int]] = field(default_factory=list)   # statistics group, positions,
                                                                                  # input and output index

    @staticmethod
    def takes(rows: torch.Tensor) -> bool:
        """Whether `rows` are small enough to be staged."""
        return rows.numel() * rows.element_size() <= STAGED_ROWS_BYTES

    @property
    def full(self) -> bool:
        return self.nbytes >= STAGE_BYTES

    def add(self, rows: torch.Tensor, shape: tuple[int, ...], by_reference: bool) -> int:
        """Stage `rows`, to be stored with `shape`; returns its index in `SealedStage.stored()`.

        By reference when asked and possible (see `changed`); otherwise a private clone, and the
        original is watched so that `changed` tells whether it would have been safe to keep."""
        if rows.requires_grad:
            rows = rows.detach()
        version = version_of(rows)
        if by_reference and version is not None:
            self.captured.append(rows)
            self.versions.append(version)
        else:
            if version is not None:
                self.watched.append((len(self.captured), rows, version))
            self.captured.append(rows.clone(memory_format=torch.contiguous_format))
            self.versions.append(None)
        self.shapes.append(shape)
        self.nbytes += rows.numel() * rows.element_size()
        return len(self.captured) - 1

    @classmethod
    def repeat(cls, layout: StageLayout, captured: list[torch.Tensor], versions: list[int | None],
               positions: np.ndarray) -> "Stage":
        """A stage of `captured` (kept by reference, with their `versions` when captured) in
        `layout`, every capture at `positions`; the caller has checked they fit it. Inference
        tensors (version None) are cloned, as `add` does; nothing outside inference mode can have
        changed them since they were captured."""
        if None in versions:
            captured = [rows.clone(memory_format=torch.contiguous_format) if version is None else rows
                        for rows, version in zip(captured, versions)]
        return cls(captured, list(layout.shapes), versions, [], layout.nbytes,
                   [(name, positions, i) for name, i in layout.rows],
                   [(name, positions, x, y) for name, x, y in layout.norms])

    def layout(self) -> StageLayout:
        """This stage's layout, for `repeat`."""
        return StageLayout(self.shapes, [math.prod(shape) for shape in self.shapes],
                           [(name, i) for name, _, i in self.rows], [(name, x, y) for name, _, x, y in self.norms],
                           self.nbytes)

    def changed(self) -> tuple[list[int], list[int]]:
        """Captures changed in place since they were added: (kept by reference, so their staged
        rows are wrong; cloned, so their clone is right and the next ones must be clones too)."""
        stale = [i for i, (rows, version) in enumerate(zip(self.captured, self.versions))
                 if version is not None and rows._version != version]
        moved = [i for i, rows, version in self.watched if rows._version != version]
        return stale, moved

    def seal(self) -> SealedStage:
        """Start the copies to host memory: the captures are flattened per device and dtype, and
        those on CUDA copied asynchronously into pinned memory. A tensor captured more than once
        (a layer's output is the next one's input, a norm's input a residual) is copied once."""
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        first: dict[int, int] = {}
        same: dict[int, tuple[int, tuple[int, ...]]] = {}
        for i, rows in enumerate(self.captured):
            j = first.setdefault(id(rows), i)       # the stage holds every capture: ids are not reused
            if j != i:
                same[i] = j, self.shapes[i]
            else:
                groups.setdefault((rows.device, rows.dtype), []).append(i)
        parts = []
        for members in groups.values():
            tensors = [self.captured[i] for i in members]
            flat = torch._utils._flatten_dense_tensors(tensors)     # one call for all (a view of a lone one)
            if flat.is_cuda:
                host = host_copy(flat)
            else:                                                   # on the CPU, a copy unless a view
                host = HostRows(flat.clone() if len(tensors) == 1 and self.versions[members[0]] is not None else flat)
            parts.append(FlatCopy(members, [self.shapes[i] for i in members], host))
        return SealedStage(len(self.captured), parts, same)

"""Host copies of captured rows, made when the rows are handed over.

A capture must be copied at once (the caller may reuse its buffer), but a decode step hands
over hundreds of small captures, and on a GPU each torch call costs tens of microseconds of
host time. Small captures therefore go into a `Stage`: each is cloned where it lives (one
call), and `seal` copies them to host memory together, one flattened, pinned, asynchronous
copy per device and dtype. Large captures get a `HostRows` copy of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvdiff.probes.trace_format import to_storage

STAGE_BYTES = 4 << 20       # a stage is sealed once it holds this much
STAGED_ROWS_BYTES = 1 << 20  # captures up to this size are staged, larger ones copied alone


def _copied_event(device: torch.device) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


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
    shapes: list[torch.Size]
    host: HostRows


@dataclass
class SealedStage:
    """The host side of a sealed stage: `stored()` waits for the copies and gives each capture's rows."""

    count: int
    parts: list[FlatCopy]

    def stored(self) -> list[tuple[np.ndarray, str]]:
        """Each capture's rows as stored in a trace (trace_format.to_storage), once its copy has
        arrived; sliced with numpy, so the writer thread makes no torch call per capture."""
        out: list[tuple[np.ndarray, str] | None] = [None] * self.count
        for part in self.parts:
            flat, dtype = to_storage(part.host.ready())
            start = 0
            for i, shape in zip(part.members, part.shapes):
                n = shape.numel()
                out[i] = flat[start:start + n].reshape(shape), dtype
                start += n
        return out


@dataclass
class Stage:
    """Small captures of one forward, each cloned where it lives when added, and what the
    writer will make of them: rows of a dataset, or a norm's input and output."""

    captured: list[torch.Tensor] = field(default_factory=list)
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

    def add(self, rows: torch.Tensor) -> int:
        """Keep a private copy of `rows`; returns its index in `SealedStage.stored()`."""
        self.captured.append(rows.detach().clone(memory_format=torch.contiguous_format))
        self.nbytes += rows.numel() * rows.element_size()
        return len(self.captured) - 1

    def seal(self) -> SealedStage:
        """Start the copies to host memory: the captures are flattened per device and dtype, and
        those on CUDA copied asynchronously into pinned memory."""
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, rows in enumerate(self.captured):
            groups.setdefault((rows.device, rows.dtype), []).append(i)
        parts = []
        for members in groups.values():
            tensors = [self.captured[i] for i in members]
            flat = torch._utils._flatten_dense_tensors(tensors)     # one call, however many captures
            host = host_copy(flat) if flat.is_cuda else HostRows(flat)   # on the CPU, flat is already a copy
            parts.append(FlatCopy(members, [t.shape for t in tensors], host))
        return SealedStage(len(self.captured), parts)

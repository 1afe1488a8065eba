"""Host copies of captured rows, made when the rows are handed over.

A capture must be copied at once (the caller may reuse its buffer), but a decode step hands
over hundreds of small captures: one copy, allocation, event and writer-thread job each would
cost more than the step. Small captures therefore go into a `Stage`, one host buffer (pinned
when rows come from CUDA, so the copies run asynchronously) that the writer thread takes as one
job; large captures get a `HostRows` copy of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

STAGE_BYTES = 4 << 20       # one stage's host buffer
STAGED_ROWS_BYTES = 1 << 20  # captures up to this size are staged, larger ones copied alone
_ALIGN = 16


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
class Stage:
    """Small captures copied into one host buffer, in order; `seal` ends it, `ready` waits for its copies."""

    pinned: bool
    buffer: torch.Tensor = field(init=False)
    used: int = 0
    cuda_devices: set[torch.device] = field(default_factory=set)
    copied: list[torch.cuda.Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.buffer = torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=self.pinned)

    @staticmethod
    def takes(rows: torch.Tensor) -> bool:
        """Whether `rows` are small enough to be staged."""
        return rows.numel() * rows.element_size() <= STAGED_ROWS_BYTES

    def fits(self, rows: torch.Tensor) -> bool:
        start = -(-self.used // _ALIGN) * _ALIGN
        return start + rows.numel() * rows.element_size() <= self.buffer.numel()

    def add(self, rows: torch.Tensor) -> torch.Tensor:
        """Copy `rows` into the buffer (asynchronously from CUDA); returns the host view holding them."""
        start = -(-self.used // _ALIGN) * _ALIGN
        nbytes = rows.numel() * rows.element_size()
        host = self.buffer[start:start + nbytes].view(rows.dtype).view(rows.shape)
        host.copy_(rows.detach(), non_blocking=self.pinned)
        if rows.is_cuda:
            self.cuda_devices.add(rows.device)
        self.used = start + nbytes
        return host

    def seal(self) -> None:
        """No more rows: mark where the copies from each CUDA device end."""
        self.copied = [_copied_event(device) for device in self.cuda_devices]

    def ready(self) -> None:
        """Wait until every row copied into the buffer has arrived."""
        for event in self.copied:
            event.synchronize()

"""Large captures on a GPU, kept there until the writer thread brings them to the host.

A prefill's captures are hundreds of MB to GBs, produced in the few milliseconds the forward
takes on a GPU, and the disk takes about a second for 2 GB. With host copies alone the forward
waits for the writer's bounded host backlog; pinning host memory for the whole trace instead
costs about half a second per GB the first time (on an H100 host). A `DeviceRows` is a copy
made on the rows' GPU (a device-to-device copy: a millisecond or two for 2 GB), so the forward
goes on at once; the writer thread copies it to the host through one pinned `Bounce` buffer, a
piece at a time, on a stream of its own, and writes each piece before the next. TraceWriter
bounds the GPU memory these copies hold (`max_device_bytes`).
"""

from __future__ import annotations

from typing import Iterator

import torch

BOUNCE_BYTES = 16 << 20


class DeviceRows:
    """A private copy of captured rows on their GPU; `cloned` completes when the copy is made."""

    def __init__(self, rows: torch.Tensor):
        self.tensor = rows.detach().clone(memory_format=torch.contiguous_format)
        self.cloned = torch.cuda.Event()
        self.cloned.record(torch.cuda.current_stream(rows.device))

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes

    def host_pieces(self, bounce: "Bounce") -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, host rows) of consecutive pieces of the rows, each in `bounce`'s buffer
        and so valid only until the next piece is asked for."""
        rows = self.tensor
        row_bytes = max(1, rows.nbytes // max(rows.shape[0], 1))
        step = max(1, bounce.nbytes // row_bytes)
        for first in range(0, rows.shape[0], step):
            yield first, bounce.fetch(rows[first:first + step], self.cloned)


class Bounce:
    """A pinned host buffer, allocated on first use, and a copy stream per GPU: the writer
    thread's way of bringing DeviceRows to the host. Used by one thread."""

    def __init__(self, nbytes: int = BOUNCE_BYTES):
        self.nbytes = nbytes
        self._buffer: torch.Tensor | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def fetch(self, rows: torch.Tensor, after: torch.cuda.Event) -> torch.Tensor:
        """Host copy of contiguous device `rows`, made once `after` has completed; it lives in the
        buffer (grown if one piece needs more) until the next fetch."""
        if self._buffer is None or self._buffer.numel() < rows.nbytes:
            self._buffer = torch.empty(max(self.nbytes, rows.nbytes), dtype=torch.uint8, pin_memory=True)
        stream = self._streams.get(rows.device)
        if stream is None:
            stream = self._streams[rows.device] = torch.cuda.Stream(rows.device)
        host = self._buffer[: rows.nbytes].view(rows.dtype).view(rows.shape)
        with torch.cuda.stream(stream):
            stream.wait_event(after)
            host.copy_(rows, non_blocking=True)
        stream.synchronize()
        return host

"""SerialWorker: runs jobs in order on one background thread, with a bounded backlog.

A producer hands the worker jobs with the bytes each keeps alive until it has run: host memory,
and GPU memory for jobs that hold rows on a GPU. When either backlog (queued and running jobs)
would pass its bound (`max_bytes`, `max_device_bytes`), `submit` blocks until the worker has
caught up: back-pressure instead of unbounded growth. A job larger than a bound alone is
admitted once that backlog is empty. The first exception a job raises stops the worker; later
jobs are dropped and the producer reads the exception from `error`.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable


class SerialWorker:
    """One daemon thread running submitted jobs in submission order."""

    def __init__(self, name: str, max_bytes: int, max_device_bytes: int = 0):
        self.max_bytes = max_bytes
        self.max_device_bytes = max_device_bytes
        self.error: BaseException | None = None
        self.peak_backlog = 0
        self.peak_device_backlog = 0
        self._jobs: deque[tuple[Callable[[], None], int, int]] = deque()
        self._backlog = 0
        self._device_backlog = 0
        self._pending = 0               # jobs queued or running
        self._stopping = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def backlog(self) -> int:
        """Bytes held by jobs queued or running."""
        with self._cond:
            return self._backlog

    def submit(self, job: Callable[[], None], nbytes: int = 0, device_bytes: int = 0) -> None:
        """Queue `job`, holding `nbytes` of host and `device_bytes` of GPU memory until it has run,
        first waiting while a backlog would pass its bound. Dropped once a job failed."""
        with self._cond:
            if self._stopping:
                raise RuntimeError("SerialWorker.submit after stop or cancel")
            while self.error is None and self._over(nbytes, device_bytes):
                self._cond.wait()
            if self.error is not None:
                return
            self._jobs.append((job, nbytes, device_bytes))
            self._pending += 1
            self._backlog += nbytes
            self._device_backlog += device_bytes
            self.peak_backlog = max(self.peak_backlog, self._backlog)
            self.peak_device_backlog = max(self.peak_device_backlog, self._device_backlog)
            self._cond.notify_all()

    def _over(self, nbytes: int, device_bytes: int) -> bool:
        host = self._backlog and self._backlog + nbytes > self.max_bytes
        device = device_bytes and self._device_backlog and self._device_backlog + device_bytes > self.max_device_bytes
        return bool(host or device)

    def wait_idle(self) -> None:
        """Block until every submitted job has run (or one has failed)."""
        with self._cond:
            while self._pending and self.error is None:
                self._cond.wait()

    def stop(self) -> None:
        """Run what is queued, then end the thread and wait for it."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()

    def cancel(self) -> None:
        """Drop what is queued, let a running job finish, end the thread and wait for it."""
        with self._cond:
            self._stopping = True
            self._drop_queued()
        self._thread.join()

    def _drop_queued(self) -> None:
        self._backlog -= sum(n for _, n, _ in self._jobs)
        self._device_backlog -= sum(d for _, _, d in self._jobs)
        self._pending -= len(self._jobs)
        self._jobs.clear()
        self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    self._cond.wait()
                if not self._jobs:
                    return
                job, nbytes, device_bytes = self._jobs.popleft()
            try:
                job()
            except BaseException as exc:  # handed to the producer, which raises it
                with self._cond:
                    self.error = exc
                    self._release(nbytes, device_bytes)
                    self._drop_queued()
                return
            del job
            with self._cond:
                self._release(nbytes, device_bytes)
                self._cond.notify_all()

    def _release(self, nbytes: int, device_bytes: int) -> None:
        self._backlog -= nbytes
        self._device_backlog -= device_bytes
        self._pending -= 1

"""SerialWorker: runs jobs in order on one background thread, with a bounded backlog.

A producer hands the worker jobs with the bytes each keeps alive until it has run. When the
backlog (queued and running jobs) would pass `max_bytes`, `submit` blocks until the worker has
caught up: back-pressure instead of unbounded growth. A job larger than the bound alone is
admitted once the backlog is empty. The first exception a job raises stops the worker; later
jobs are dropped and the producer reads the exception from `error`.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable


class SerialWorker:
    """One daemon thread running submitted jobs in submission order."""

    def __init__(self, name: str, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self.error: BaseException | None = None
        self.peak_backlog = 0
        self._jobs: deque[tuple[Callable[[], None], int]] = deque()
        self._backlog = 0
        self._stopping = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def backlog(self) -> int:
        """Bytes held by jobs queued or running."""
        with self._cond:
            return self._backlog

    def submit(self, job: Callable[[], None], nbytes: int = 0) -> None:
        """Queue `job`, first waiting while the backlog would pass the bound. Dropped once a job failed."""
        with self._cond:
            if self._stopping:
                raise RuntimeError("SerialWorker.submit after stop or cancel")
            while self.error is None and self._backlog and self._backlog + nbytes > self.max_bytes:
                self._cond.wait()
            if self.error is not None:
                return
            self._jobs.append((job, nbytes))
            self._backlog += nbytes
            self.peak_backlog = max(self.peak_backlog, self._backlog)
            self._cond.notify_all()

    def wait_idle(self) -> None:
        """Block until every submitted job has run (or one has failed)."""
        with self._cond:
            while self._backlog and self.error is None:
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
        self._backlog -= sum(n for _, n in self._jobs)
        self._jobs.clear()
        self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    self._cond.wait()
                if not self._jobs:
                    return
                job, nbytes = self._jobs.popleft()
            try:
                job()
            except BaseException as exc:  # handed to the producer, which raises it
                with self._cond:
                    self.error = exc
                    self._backlog -= nbytes
                    self._drop_queued()
                return
            del job
            with self._cond:
                self._backlog -= nbytes
                self._cond.notify_all()

"""How fast a folder's disk takes a trace's bytes, written in the ways a trace writer could.

    python benchmarks/disk_rate.py [--folder /tmp] [--gb 2.12] [--threads 1 2 4 8] [--repeats 3]

Writes `--gb` GB from host memory into a new file, split evenly over 1, 2, 4 ... threads:
`os.pwrite` in 1 MB pieces (as `LatchingFile.pwrite` does), `os.pwrite` of each thread's whole
range, and numpy copies into a shared memory map of the file. Prints the best and median time
of `--repeats` runs and the best rate. The file is removed after each run (untimed). Page-cache
writes: nothing is synced, as a trace is not.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import threading
import time
from typing import Callable

import numpy as np

PIECE = 1 << 20


def in_threads(count: int, nbytes: int, write_range: Callable[[int, int], None]) -> None:
    """Run `write_range(lo, hi)` on `count` threads over consecutive, PIECE-aligned byte ranges."""
    bounds = [nbytes * i // count // PIECE * PIECE for i in range(count)] + [nbytes]
    threads = [threading.Thread(target=write_range, args=(lo, hi)) for lo, hi in zip(bounds, bounds[1:])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def pwrite_pieces(path: str, data: np.ndarray, count: int) -> None:
    view, fd = memoryview(data), os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)

    def write_range(lo: int, hi: int) -> None:
        for at in range(lo, hi, PIECE):
            os.pwrite(fd, view[at:min(hi, at + PIECE)], at)

    try:
        in_threads(count, data.size, write_range)
    finally:
        os.close(fd)


def pwrite_ranges(path: str, data: np.ndarray, count: int) -> None:
    view, fd = memoryview(data), os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)

    def write_range(lo: int, hi: int) -> None:
        while lo < hi:
            lo += os.pwrite(fd, view[lo:hi], lo)

    try:
        in_threads(count, data.size, write_range)
    finally:
        os.close(fd)


def mmap_copies(path: str, data: np.ndarray, count: int) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        os.ftruncate(fd, data.size)
        with mmap.mmap(fd, data.size) as mapped:
            target = np.frombuffer(mapped, dtype=np.uint8)
            in_threads(count, data.size, lambda lo, hi: np.copyto(target[lo:hi], data[lo:hi]))
            del target
    finally:
        os.close(fd)


WAYS = {"pwrite, 1 MB pieces": pwrite_pieces, "pwrite, whole ranges": pwrite_ranges, "mmap copies": mmap_copies}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="/tmp", help="where the file is written")
    parser.add_argument("--gb", type=float, default=2.12, help="how much to write (2.12: the 1B prompt-heavy trace)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.gb <= 0 or args.repeats < 1 or min(args.threads) < 1:
        parser.error("--gb, --repeats and --threads must be positive")
    data = np.full(int(args.gb * 1e9), 7, dtype=np.uint8)
    path = os.path.join(args.folder, f"disk-rate-{os.getpid()}.bin")
    print(f"{data.size / 1e9:.2f} GB into {args.folder}, best and median of {args.repeats}")
    for way, write in WAYS.items():
        for count in args.threads:
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                write(path, data, count)
                times.append(time.perf_counter() - start)
                os.remove(path)
            print(f"  {way:22} {count} thread(s): {min(times):6.3f} s  {statistics.median(times):6.3f} s  "
                  f"{data.size / min(times) / 1e9:5.2f} GB/s", flush=True)


if __name__ == "__main__":
    main()

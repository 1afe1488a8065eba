"""The long fuzz run: mutated traces and case files fed to `kvdiff diff`, `inspect` and `gate`.

    python scripts/fuzz.py [--examples 10000] [--targets diff,inspect,gate] [--seed N]

Runs N examples per target with hypothesis (generation only: no shrinking, no example database),
keeps going past a failing example, and prints a summary per target: examples run, distinct
failures (each with one input that shows it), exit codes seen, and time. Exits 1 when any example
failed. The targets and the property they check are in tests/fuzz_targets.py; tests/test_fuzz.py
runs a few hundred of the same examples in CI.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from hypothesis import HealthCheck, Phase, seed, settings  # noqa: E402

import fuzz_targets  # noqa: E402


def _signature(message: str) -> str:
    """A failure's message without temporary paths, so repeats of one bug count once."""
    return re.sub(r"/tmp/\S+", "<tmp>", message)[:300]


def run_target(name: str, examples: int, run_seed: int) -> tuple[int, dict[str, str], Counter, float]:
    """Run one target; (examples run, failure signature -> one failing input, exit codes, seconds)."""
    run, _ = fuzz_targets.TARGETS[name]
    failures: dict[str, str] = {}
    count = 0

    def body(**kwargs) -> None:
        nonlocal count
        count += 1
        try:
            run(**kwargs)
        except fuzz_targets.FuzzFailure as exc:
            failures.setdefault(_signature(str(exc)), repr(kwargs)[:2000])
        except Exception as exc:  # a bug of the harness itself: reported, the run goes on
            failures.setdefault(_signature(f"harness error {type(exc).__name__}: {exc}"), repr(kwargs)[:2000])

    fuzz_targets.EXIT_CODES.clear()
    test = settings(max_examples=examples, database=None, deadline=None, phases=[Phase.generate],
                    suppress_health_check=list(HealthCheck))(fuzz_targets.fuzz_test(name, body))
    start = time.perf_counter()
    seed(run_seed)(test)()
    return count, failures, Counter(fuzz_targets.EXIT_CODES), time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=10_000, help="Examples per target (default 10000).")
    ap.add_argument("--targets", default=",".join(fuzz_targets.TARGETS), help="Comma-separated targets.")
    ap.add_argument("--seed", type=int, default=None, help="Hypothesis seed (default: random, printed).")
    args = ap.parse_args()
    names = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in names if t not in fuzz_targets.TARGETS]
    if unknown:
        ap.error(f"unknown target(s) {', '.join(unknown)}: choose from {', '.join(fuzz_targets.TARGETS)}")
    run_seed = random.randrange(2 ** 32) if args.seed is None else args.seed
    print(f"kvdiff fuzz: {args.examples} examples per target, seed {run_seed}, {platform.node()}, "
          f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}", flush=True)
    total_examples = total_failures = 0
    total_start = time.perf_counter()
    for name in names:
        count, failures, codes, seconds = run_target(name, args.examples, run_seed)
        total_examples += count
        total_failures += len(failures)
        print(f"{name}: {count} examples, {len(failures)} distinct failures, {seconds:.0f} s "
              f"({seconds / max(count, 1) * 1000:.0f} ms each); exit codes {dict(sorted(codes.items()))}", flush=True)
        for signature, example in failures.items():
            print(f"  FAIL {signature}\n       input: {example}", flush=True)
    print(f"total: {total_examples} examples, {total_failures} distinct failures, "
          f"{time.perf_counter() - total_start:.0f} s", flush=True)
    return 1 if total_failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""`kvdiff compare --engine X`, second question: does the engine compute what kvdiff's reference
path computes on the same checkpoint?

Cold and warm agreeing says nothing of a bug that hits every run of the engine alike (a wrong
RoPE base, a changed projection, a norm's epsilon). Those part the engine's cold run from the
reference's trace. Both traces are diffed; in digest mode both run once more with a window in
full (as the cold / warm zoom does) so that the diagnoses read tensors. The window is placed at
the first row the statistics prove beyond tolerance; an engine's kernels are not the reference's,
so their bits differ nearly everywhere, and the first bit difference says little. Where no row
is proved beyond tolerance but bits differ, the window is the first bit difference's: a bug that
moves rows by less than the tolerance (a norm's epsilon) is still found by the rules that
recompute a run's own operations there. The reference's zoom run must repeat its first run, and
the engine's its cold run, digest for digest; where one does not, a `nondeterministic` finding
says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from kvdiff.analysis import Divergence, diff
from kvdiff.options import TraceMode
from kvdiff.run.options import RunOptions
from kvdiff.run.zoom import checked_repeat, diagnoses_with, repeat_findings, zoom_window

REFERENCE_FIRST = "reference.first.h5"       # digest mode: kept where the reference's zoom run disagrees with it
COLD_WINDOW = "cold-vs-reference.h5"         # the engine's cold run with the engine-vs-reference window in full

# record(path, window): one run of a side into `path`, with `window` (ZoomWindow.recorder_args) in full
Recorder = Callable[[Path, dict], None]


def against_reference(out_dir: Path, record_reference: Recorder, record_cold: Recorder, options: RunOptions,
                      num_layers: int, tokenizer, step: Callable[[str], None]) -> tuple[Divergence, dict]:
    """The engine's cold run (cold.h5) diffed against the reference (reference.h5), zoomed in
    digest mode where they differ (see the module docstring); the divergence and report.json's
    `engine_vs_reference` findings (where they part, the operation, the diagnoses, the window)."""
    reference, cold = out_dir / "reference.h5", out_dir / "cold.h5"
    against = diff(reference, cold, tokenizer=tokenizer)
    window = None
    if options.trace_mode is TraceMode.DIGEST:
        window = zoom_window(against, num_layers, options.zoom_layers, options.zoom_positions, beyond_tolerance=True) \
            or zoom_window(against, num_layers, options.zoom_layers, options.zoom_positions)
    findings = []
    if window is not None:
        step(f"engine vs reference: {window.described} in full")
        flip = against.first_token_divergence
        args = window.recorder_args(None if flip is None else flip.position)
        reference.replace(out_dir / REFERENCE_FIRST)
        record_reference(reference, args)
        record_cold(out_dir / COLD_WINDOW, args)
        findings = checked_repeat((out_dir / REFERENCE_FIRST,), (reference,), ("reference",))
        findings += repeat_findings((cold,), (out_dir / COLD_WINDOW,), ("engine's cold run",))
        against = diff(reference, out_dir / COLD_WINDOW, tokenizer=tokenizer)
        diagnoses_with(against, findings)
    return against, {**against.findings_json(), "zoom": None if window is None else window.to_json(),
                     "repeated": not findings}

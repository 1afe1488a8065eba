"""Digest capture's second pass: the zoom window around the first divergence, and the check that
the zoom run repeated the first one.

A first pass records digests only; where they part, both sides run again recording full rows in
a window of layers x positions. The window holds `layers` layers from the first whose digests
differ at or after the first differing position, and the one before it (where they agree), and spans `positions` positions from the first differing
one; when that position is early (below ZOOM_FROM_START) the window starts at position 0
instead, so that attention at its positions can be recomputed from keys that are all recorded
(the missing_context proofs); where every position of it was read from a cache, it reaches the
first position both sides computed. Where it starts later and attention's output (z or attn_out) is
the first point to differ at its first differing layer, the window keeps k and v of its layers at
every earlier position too (its `keys`, up to MAX_KEY_POSITIONS): attention read them, and its
hypotheses are recomputed from them.
The zoom run records digests too: where they are not the first pass's, the engine did not repeat
itself, a finding reported as `nondeterministic`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kvdiff.analysis import Divergence
from kvdiff.analysis.diagnosis import Diagnosis
from kvdiff.analysis.digests import first_digest_mismatch
from kvdiff.analysis.search import Location, bits_differ, breaches_tolerance
from kvdiff.analysis.tolerance import Tier
from kvdiff.trace import open_trace

ZOOM_LAYERS = 2
ZOOM_POSITIONS = 64
ZOOM_FROM_START = 256
MAX_KEY_POSITIONS = 8192     # the most earlier positions whose keys a window keeps (k and v of its layers)
ATTENTION_OUTPUTS = ("z", "attn_out")
FIRST_PASS = ("reference.first.h5", "candidate.first.h5")    # kept beside the zoom traces when they disagree


@dataclass(frozen=True)
class ZoomWindow:
    """Layers and positions (first, last: inclusive) recorded in full by a zoom run."""

    layers: tuple[int, int]
    positions: tuple[int, int]
    keys: tuple[int, int] | None = None      # positions before the window whose k and v are kept too

    @property
    def layer_range(self) -> str:
        return f"{self.layers[0]}-{self.layers[1]}"

    @property
    def position_range(self) -> str:
        return f"{self.positions[0]}-{self.positions[1]}"

    def to_json(self) -> dict:
        out = {"layers": list(self.layers), "positions": list(self.positions)}
        return out if self.keys is None else {**out, "key_positions": list(self.keys)}

    @property
    def described(self) -> str:
        """The window in words, for progress lines."""
        keys = "" if self.keys is None else f" (k and v at {self.keys[0]}-{self.keys[1]} too)"
        return f"layers {self.layer_range}, positions {self.position_range}{keys}"

    def row_args(self) -> dict:
        """`TraceRecorder.for_model`'s arguments for this window's rows (`layers`, `positions`,
        `key_positions`)."""
        keys = None if self.keys is None else f"{self.keys[0]}-{self.keys[1]}"
        return dict(layers=self.layer_range, positions=self.position_range, key_positions=keys)

    def holds(self, cell: Location) -> bool:
        """Whether the cell is inside the window (a final point's layer: any)."""
        layer_in = cell.layer is None or self.layers[0] <= cell.layer <= self.layers[1]
        return layer_in and self.positions[0] <= cell.position <= self.positions[1]

    def recorder_args(self, flip_position: int | None) -> dict:
        """`TraceRecorder.for_model`'s window arguments: this window, with the final points, and
        the logits at the first token flip (`flip_position`) where it lies outside."""
        args = self.row_args()
        if flip_position is not None and not self.positions[0] <= flip_position <= self.positions[1]:
            args["positions"] += f",{flip_position}"
        return {**args, "window_final": True}


def zoom_window(first_pass: Divergence, num_layers: int, layers: int = ZOOM_LAYERS,
                positions: int = ZOOM_POSITIONS, beyond_tolerance: bool = False) -> ZoomWindow | None:
    """The window around the first bit difference of a digest-only diff; None where none differs.
    `beyond_tolerance`: around the first row the statistics prove beyond tolerance instead, for
    two runs whose bits differ everywhere (an engine against the reference); so too where the first
    differing bits are not proved beyond tolerance and the first row that is lies outside their
    window (noise or an unsized difference at layer 0, the divergence at layer 20: the window then
    holds the divergence, which the diagnoses explain); where it lies inside their window, that
    window reaches `positions` positions past it too (the rows the diagnoses test)."""
    bits, breach = first_pass.first_bit_difference, first_pass.first_divergence
    if bits is None:
        return None
    if beyond_tolerance:
        return None if breach is None else _around(first_pass, breach, breaches_tolerance, num_layers, layers, positions)
    window = _around(first_pass, bits, bits_differ, num_layers, layers, positions)
    if breach is None or bits.tier == Tier.DIVERGENT.label:
        return window
    # a final point's breach needs the last layer too: the final norm's input is its resid_post
    if not window.holds(breach) or breach.layer is None and window.layers[1] < num_layers - 1:
        return _around(first_pass, breach, breaches_tolerance, num_layers, layers, positions)
    end = min(breach.position + positions - 1, int(first_pass.comparison.alignment.positions.max()))
    return replace(window, positions=(window.positions[0], max(window.positions[1], end)))


def _around(first_pass: Divergence, first: Location, cells, num_layers: int, layers: int,
            positions: int) -> ZoomWindow:
    """The window from `first` (the first cell of `cells`: bits differing, or beyond tolerance)."""
    cmp = first_pass.comparison
    last_position = int(cmp.alignment.positions.max())
    start = 0 if first.position < ZOOM_FROM_START else first.position
    end = min(first.position + positions - 1, last_position)
    al = cmp.alignment
    computed = al.positions[al.computed & (al.positions >= first.position)]
    if computed.size and computed[0] > end:
        # every row of the window read from a cache (a long hit): reach the first row both sides
        # computed, so that the zoom traces hold full rows and the analysis has attention to test
        end = int(computed[0])
    in_window = (cmp.alignment.positions >= first.position) & (cmp.alignment.positions <= end)
    differing = [layer for pmap in cmp.points.values() for row, layer in enumerate(pmap.layers)
                 if (cells(pmap)[row] & in_window).any()]
    low = min(differing, default=num_layers - 1)
    keys = (0, start - 1) if 0 < start <= MAX_KEY_POSITIONS and _attention_first(cmp, cells, low, in_window) else None
    # and the layer before, where the rows still agree: the cached-context proofs read K/V there
    return ZoomWindow((max(low - 1, 0), min(low + layers - 1, num_layers - 1)), (start, end), keys)


def _attention_first(cmp, cells, layer: int, in_window: np.ndarray) -> bool:
    """Whether, at `layer`'s first position in the window where any point's cells differ, the first
    of them in dataflow order is attention's output (z, or attn_out): what attention read there agrees."""
    found = [(int(np.argmax(hit)), order, point) for order, (point, pmap) in enumerate(cmp.points.items())
             if layer in pmap.layers and (hit := cells(pmap)[pmap.layers.index(layer)] & in_window).any()]
    return bool(found) and min(found)[2] in ATTENTION_OUTPUTS


def repeat_findings(first_pass: tuple[Path, ...], zoom: tuple[Path, ...],
                    sides: tuple[str, ...] = ("reference", "candidate")) -> list[Diagnosis]:
    """A `nondeterministic` diagnosis for each of `sides` whose zoom run's digests are not its
    first run's."""
    out = []
    for side, first, again in zip(sides, first_pass, zoom):
        with open_trace(first) as a, open_trace(again) as b:
            where = first_digest_mismatch(a, b)
        if where is None:
            continue
        layer, point, position = where
        at = f"{point} at layer {layer}" if layer is not None else point
        out.append(Diagnosis(
            kind="nondeterministic", chunk=None, positions=(position, position),
            evidence=f"the {side}'s zoom run is not its first run: {at}, position {position}, digests differently "
                     "on the same input",
            details={"side": side, "layer": layer, "tensor": point},
            confidence=1.0,
            proof=f"the {side} ran the same request twice; the row digests of {at} at position {position} "
                  "differ between the runs (a different hash is different bits; statistics apart by more than "
                  "their float32 rounding are a different row)"))
    return out


def checked_repeat(first_pass: tuple[Path, ...], zoom: tuple[Path, ...],
                   sides: tuple[str, ...] = ("reference", "candidate")) -> list[Diagnosis]:
    """`repeat_findings`; the first pass's traces are deleted when every side repeated itself,
    and kept beside the zoom run's otherwise."""
    findings = repeat_findings(first_pass, zoom, sides)
    if not findings:
        for path in first_pass:
            path.unlink()
    return findings


def diagnoses_with(divergence: Divergence, findings: list[Diagnosis]) -> None:
    """Add `findings` to the divergence's diagnoses, in position order. A run that did not repeat
    itself only after the runs' first bit difference (a later position, or a later layer of it)
    repeated everything up to it: that finding says so (`after_first_difference`), and the
    diagnoses made there stand."""
    first, placed = divergence.first_bit_difference, []
    for finding in findings:
        layer, position = finding.details.get("layer"), finding.positions[0]
        if first is not None and (position > first.position or (
                position == first.position and layer is not None and first.layer is not None and layer > first.layer)):
            finding = replace(finding, details={**finding.details, "after_first_difference": True}, evidence=(
                f"{finding.evidence}; after the runs' first bit difference (layer {first.layer}, position "
                f"{first.position}), which both runs repeated: what is diagnosed there stands"))
        placed.append(finding)
    divergence.diagnoses = sorted(divergence.diagnoses + placed,
                                  key=lambda d: d.positions[0] if d.positions else -1)


def digest_section(window: ZoomWindow | None, findings: list[Diagnosis], sizes: dict[str, int],
                   first_positions: np.ndarray) -> dict:
    """report.json's `digest` section: the window, whether the zoom run repeated the first, sizes."""
    return {"zoom": None if window is None else window.to_json(),
            "repeated": not findings, "positions_digested": int(first_positions.size),
            "trace_bytes": sizes}

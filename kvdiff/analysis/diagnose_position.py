"""position_mismatch and rope_mismatch: the first layer's keys are their content rotated otherwise.

Of the first-layer keys that differ, each against the content it rotates (keys.py: the candidate's
own k_pre_rope where it computed the row, the reference's where it read it from a cache):
- rotations that fit integer positions exactly, every one of them, at other positions than
  expected: position_mismatch, with the offset;
- rotations that fit no integer position as well as rounding allows (some of them): RoPE's
  frequencies differ: rope_mismatch, with the candidate's frequencies measured at the expected
  positions and what they fit (a linear scaling factor, another base). A claim of integer positions
  is then never made: with other frequencies, an integer fit is a coincidence (scaling 2 rotates
  even positions p exactly as p/2);
- rotations with every pair magnitude times one factor, at positions the candidate computed:
  rope_mismatch (RoPE's cos/sin scaled). Read from a cache, scaled or other content is
  cache_content_mismatch's (diagnose_cache);
- computed rows that are no rotation of the reference's pairs (i, i + d/2) but, every one of them,
  an exact rotation of the interleaved pairs (2i, 2i+1) to the expected position with the
  reference's frequencies: rope_mismatch, RoPE's pairing convention (`convention`).
"""

from __future__ import annotations

import logging

import numpy as np

from kvdiff.analysis.diagnosis import Diagnosis, DiagnosisInputs, fmt, group_by_chunk, span_text
from kvdiff.analysis.keys import CONTENT, ROTATION, SCALED, KeyRows, measure_frequencies

log = logging.getLogger(__name__)


def _same(inputs: DiagnosisInputs, keys: KeyRows, gcols: np.ndarray) -> str:
    if keys.cached[np.isin(keys.cols, gcols)].all():
        v_abs, _ = inputs.worst("v", 0, gcols)
        return (f"read from the cache, v matches the reference (max_abs {fmt(v_abs)}) and k's rotate_half pairs have "
                f"the reference's magnitudes, so the cache holds these tokens' keys,")
    kp_abs, _ = inputs.worst("k_pre_rope", 0, gcols)
    if inputs.ok("k_pre_rope", 0)[gcols].all():
        return f"k_pre_rope matches the reference (max_abs {fmt(kp_abs)})"
    return (f"k_pre_rope differs from the reference's (max_abs {fmt(kp_abs)}), but k is the candidate's own "
            f"k_pre_rope rotated (pair magnitudes equal)")


def _positions(inputs: DiagnosisInputs, keys: KeyRows) -> list[Diagnosis]:
    positions, layer = inputs.comparison.alignment.positions, inputs.first_layer
    offsets = keys.encoded - positions[keys.cols]
    moved = offsets != 0
    out = []
    for chunk, group in group_by_chunk(inputs, positions[keys.cols[moved]]):
        sel = moved & np.isin(positions[keys.cols], group)
        gcols, enc, quality = keys.cols[sel], keys.encoded[sel], keys.quality[sel]
        lo, hi = int(group[0]), int(group[-1])
        values, counts = np.unique(offsets[sel], return_counts=True)
        offset = int(values[counts.argmax()])
        _, k_rel = inputs.worst("k", 0, gcols)
        factor = position_factor(enc, positions[gcols]) if values.size > 1 else None
        # one offset for the rows where one holds most of them; else the evidence gives the spread
        single = not factor and 2 * int(counts.max()) > group.size
        shift = f"offset {offset:+d}" if single else f"offsets {int(values[0]):+d} to {int(values[-1]):+d}"
        evidence = (f"layer {layer}, positions {span_text(lo, hi)}: {_same(inputs, keys, gcols)} while k after RoPE "
                    f"differs (rel {fmt(k_rel)}), so the keys hold the same content rotated to other positions; the "
                    f"rotation angles fit encoded positions {_span(int(enc.min()), int(enc.max()))} (fit quality "
                    f"{fmt(float(quality.min()))}), expected {span_text(lo, hi)}: "
                    + (_factor_text(factor) if factor else shift))
        if not factor and values.size > 1 and enc.min() == enc.max():
            evidence += (f" (every one of them encoded at position {int(enc[0])}"
                         + (": the keys were stored without RoPE)" if enc[0] == 0 else ")"))
        elif not factor and values.size > 1:
            evidence += f" ({values.size} different offsets, {int(counts.max())} of {group.size} positions at {offset:+d})"
        details: dict = {"offset": offset if single else None, "encoded_positions": [int(enc.min()), int(enc.max())],
                         "expected_positions": [lo, hi], "fit_quality": float(quality.min()), "layer": layer,
                         "position_factor": factor}
        reported = [inputs.chunks.encoded_position(int(p)) for p in group]
        if all(r is not None for r in reported):
            details["provenance_encoded_positions"] = [min(reported), max(reported)]
            evidence += f"; the candidate's provenance says it encoded them at {span_text(reported[0], reported[-1])}"
        proof = (f"k = k_pre_rope rotated to integer positions at all {group.size} rows (pair magnitudes equal, "
                 f"fit quality >= {fmt(float(quality.min()))}; exact from {fmt(keys.threshold)}), every rotation of "
                 f"the first layer fitting one")
        out.append(Diagnosis("position_mismatch", chunk, (lo, hi), evidence, details,
                             confidence=float(quality.min()), proof=proof))
    return out


def _span(lo: int, hi: int) -> str:
    return span_text(lo, hi) if lo >= 0 else f"{lo} to {hi}"


def _factor_text(factor: int) -> str:
    if factor == -1:
        return ("every one of them encoded at minus its position: rotated the other way (the sign of RoPE's sin "
                "flipped, or rotate_half's halves swapped)")
    return (f"every one of them encoded at {factor} times its position (RoPE applied {factor} times, or its "
            f"positions or frequencies scaled by {factor})")


def position_factor(encoded: np.ndarray, expected: np.ndarray) -> int | None:
    """f where every row is encoded at exactly f times its expected position (f >= 2, or f < 0: -1 is
    a rotation the other way; at least two rows), else None."""
    if encoded.size < 2 or (expected <= 0).any() or (encoded % expected).any():
        return None
    ratios = np.unique(encoded // expected)
    return int(ratios[0]) if ratios.size == 1 and (ratios[0] >= 2 or ratios[0] < 0) else None


def _frequencies(inputs: DiagnosisInputs, keys: KeyRows) -> list[Diagnosis]:
    """The rotations fit no integer positions: RoPE's frequencies, measured at the expected positions."""
    positions, layer = inputs.comparison.alignment.positions, inputs.first_layer
    content, cand_k = inputs.key_content, inputs.rows(layer, "k")[1]
    freq = measure_frequencies(content[keys.cols], cand_k[keys.cols], positions[keys.cols], inputs.thetas)
    inexact = int((~keys.exact).sum())
    found, details = "", {"layer": layer, "fit_quality": float(keys.quality.min())}
    if freq is not None:
        ratio = freq.candidate / freq.reference
        details.update(frequency_ratio=[float(ratio.min()), float(ratio.max())], frequency_fit=freq.quality)
        if freq.scaling is not None and freq.candidate_base is not None:
            details.update(base=freq.candidate_base, reference_base=freq.reference_base, scaling_factor=freq.scaling)
            found = (f"; the candidate's rotation rates, measured at the expected positions, fit RoPE base "
                     f"{fmt(freq.candidate_base)} with positions scaled by 1/{fmt(freq.scaling)} (linear RoPE scaling "
                     f"{fmt(freq.scaling)}; the reference's: base {fmt(freq.reference_base)}, unscaled)")
        elif freq.scaling is not None:
            details["scaling_factor"] = freq.scaling
            found = (f"; the candidate's rotation rates, measured at the expected positions, are the reference's "
                     f"divided by {fmt(freq.scaling)} at every frequency: positions scaled by 1/{fmt(freq.scaling)} "
                     f"(linear RoPE scaling {fmt(freq.scaling)})")
        elif freq.candidate_base is not None:
            details.update(base=freq.candidate_base, reference_base=freq.reference_base)
            found = (f"; the candidate's rotation rates, measured at the expected positions, fit RoPE base "
                     f"{fmt(freq.candidate_base)} (the reference's: {fmt(freq.reference_base)})")
        else:
            found = (f"; the candidate's rotation rates, measured at the expected positions, are the reference's "
                     f"times {fmt(float(ratio.min()))}-{fmt(float(ratio.max()))} (no single base or scaling fits)")
    proof = (f"k = k_pre_rope rotated (pair magnitudes equal) at {keys.cols.size} rows, but {inexact} of them fit no "
             f"integer position with the reference's frequencies (best fit quality {fmt(float(keys.quality.min()))}, "
             f"exact from {fmt(keys.threshold)})"
             + ("" if freq is None else f"; the measured frequencies explain the rotations with fit quality {fmt(freq.quality)}"))
    out = []
    for chunk, group in group_by_chunk(inputs, positions[keys.cols]):
        gcols = keys.cols[np.isin(positions[keys.cols], group)]
        lo, hi = int(group[0]), int(group[-1])
        _, k_rel = inputs.worst("k", 0, gcols)
        evidence = (f"layer {layer}, positions {span_text(lo, hi)}: {_same(inputs, keys, gcols)} while k after RoPE "
                    f"differs (rel {fmt(k_rel)}): the same content rotated otherwise, and no integer position fits "
                    f"the rotation (fit quality {fmt(float(keys.quality.min()))}): RoPE's frequencies differ, not "
                    f"the positions{found}")
        confidence = 1.0 - float(keys.quality.min()) if freq is None else freq.quality
        out.append(Diagnosis("rope_mismatch", chunk, (lo, hi), evidence, dict(details, expected_positions=[lo, hi]),
                             confidence=min(max(confidence, 0.0), 1.0), proof=proof))
    return out


def _scaled(inputs: DiagnosisInputs, keys: KeyRows) -> list[Diagnosis]:
    """Computed rows whose k pairs are k_pre_rope's times one factor: RoPE's cos and sin scaled."""
    positions, layer = inputs.comparison.alignment.positions, inputs.first_layer
    out = []
    for chunk, group in group_by_chunk(inputs, positions[keys.cols]):
        sel = np.isin(positions[keys.cols], group)
        factor, quality = keys.factor[sel], keys.quality[sel]
        lo, hi = int(group[0]), int(group[-1])
        where = "at the expected positions" if (keys.encoded[sel] == group).all() and keys.exact[sel].all() else \
            "at other angles too"
        evidence = (f"layer {layer}, positions {span_text(lo, hi)}: k_pre_rope matches the reference while every "
                    f"rotate_half pair of k has the reference's magnitude times {fmt(float(np.median(factor)))}, "
                    f"rotated {where}: RoPE scales its cos and sin (attention scaling), or k after it")
        proof = (f"k's pair magnitudes / k_pre_rope's: {fmt(float(factor.min()))}-{fmt(float(factor.max()))} at "
                 f"{group.size} rows, residual <= {fmt(float(keys.magnitude_rel[sel].max()))} of the largest")
        out.append(Diagnosis("rope_mismatch", chunk, (lo, hi), evidence, {
            "layer": layer, "magnitude_factor": float(np.median(factor)), "expected_positions": [lo, hi],
            "fit_quality": float(quality.min())}, confidence=1.0, proof=proof))
    return out


def diagnose_position_mismatch(inputs: DiagnosisInputs) -> list[Diagnosis]:
    """position_mismatch and rope_mismatch of the first layer's keys (see the module docstring)."""
    keys = inputs.keys
    if keys is None or not keys.cols.size:
        return []
    if inputs.thetas is None:
        log.debug("k differs after RoPE, but RoPE frequencies could not be measured (the reference needs two "
                  "consecutive positions)")
        return []
    rotations = keys.where(keys.kind == ROTATION)
    out = []
    if rotations.cols.size:
        out += _positions(inputs, rotations) if rotations.exact.all() else _frequencies(inputs, rotations)
    scaled = keys.where((keys.kind == SCALED) & ~keys.cached)
    if scaled.cols.size:
        out += _scaled(inputs, scaled)
    other = keys.where((keys.kind == CONTENT) & ~keys.cached)
    if other.cols.size:
        out += _convention(inputs, other)
    return out


def _convention(inputs: DiagnosisInputs, other: KeyRows) -> list[Diagnosis]:
    """Computed rows whose k is no rotate_half rotation of k_pre_rope: where every one of them is
    k_pre_rope rotated with interleaved pairs (2i, 2i+1) to its expected position, with the
    reference's frequencies, RoPE ran in the other pairing convention."""
    positions, layer = inputs.comparison.alignment.positions, inputs.first_layer
    alt = inputs.interleaved_keys(other.cols)
    expected = positions[alt.cols]
    if not ((alt.kind == ROTATION) & alt.exact & (alt.encoded == expected)).all():
        log.debug("k differs from a rotation of k_pre_rope at %d computed rows, in either pairing", other.cols.size)
        return []
    quality = float(alt.quality.min())
    proof = (f"k = k_pre_rope rotated with pairs (2i, 2i+1) at all {alt.cols.size} rows that are no rotation of "
             f"pairs (i, i + d/2) (largest pair magnitude change there {fmt(float(other.magnitude_rel.max()))} of the "
             f"row's largest): magnitudes equal, angles fitting the expected positions with the reference's "
             f"frequencies (fit quality >= {fmt(quality)}; exact from {fmt(alt.threshold)})")
    out = []
    for chunk, group in group_by_chunk(inputs, expected):
        gcols = alt.cols[np.isin(expected, group)]
        lo, hi = int(group[0]), int(group[-1])
        _, k_rel = inputs.worst("k", 0, gcols)
        evidence = (f"layer {layer}, positions {span_text(lo, hi)}: {_same(inputs, alt, gcols)} while k after RoPE "
                    f"differs (rel {fmt(k_rel)}): k is k_pre_rope rotated to the expected positions with the "
                    f"reference's frequencies, but with dims 2i and 2i+1 as a pair (the interleaved, GPT-J "
                    f"convention) where the reference pairs dim i with i + d/2 (rotate_half, the NeoX convention): "
                    f"RoPE's pairing convention differs")
        out.append(Diagnosis("rope_mismatch", chunk, (lo, hi), evidence, {
            "layer": layer, "convention": "interleaved", "reference_convention": "rotate_half",
            "expected_positions": [lo, hi], "fit_quality": quality}, confidence=quality, proof=proof))
    return out

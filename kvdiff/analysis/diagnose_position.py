"""position_mismatch: keys equal before RoPE but not after, so RoPE used other positions."""

from __future__ import annotations

import logging

import numpy as np

from kvdiff.analysis.diagnosis import Diagnosis, DiagnosisInputs, fmt, group_by_chunk, span_text
from kvdiff.analysis.rope import estimate_positions

log = logging.getLogger(__name__)


def _encoded(inputs: DiagnosisInputs, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Encoded position and fit quality of the candidate's first-layer keys at columns `cols`
    (where the candidate read its K/V from a cache, the reference's k_pre_rope stands in)."""
    if inputs.thetas is None:
        return None
    ref_pre, cand_pre = inputs.rows(inputs.first_layer, "k_pre_rope")
    k = inputs.rows(inputs.first_layer, "k")[1]
    k_pre = np.where(inputs.comparison.alignment.kv_only[cols, None, None], ref_pre[cols], cand_pre[cols])
    horizon = 2 * int(inputs.comparison.alignment.positions.max()) + 64
    return estimate_positions(k_pre, k[cols], inputs.thetas, horizon)


def diagnose_position_mismatch(inputs: DiagnosisInputs) -> list[Diagnosis]:
    """One diagnosis per candidate chunk whose first-layer k_pre_rope matches but k does not, unless
    the keys' rotation angles fit the expected positions exactly (then RoPE's arithmetic differs,
    e.g. its precision, not the positions it used)."""
    kp_ok, k_bad, v_ok = inputs.ok("k_pre_rope", 0), inputs.divergent("k", 0), inputs.ok("v", 0)
    if kp_ok is None or k_bad is None:
        return []
    al = inputs.comparison.alignment
    positions = al.positions
    # Read from a cache, K/V have no k_pre_rope row; a matching first-layer v (a function of the
    # token alone) shows the cache holds these tokens' keys, whose content k_pre_rope would show.
    cached_content = al.kv_only & (v_ok if v_ok is not None else False)
    cols = np.flatnonzero((kp_ok | cached_content) & k_bad)
    if not cols.size:
        return []
    fit = _encoded(inputs, cols)
    layer = inputs.first_layer
    out = []
    for chunk, group in group_by_chunk(inputs, positions[cols]):
        gcols = cols[np.isin(positions[cols], group)]
        _, k_rel = inputs.worst("k", 0, gcols)
        lo, hi = int(group[0]), int(group[-1])
        if al.kv_only[gcols].all():
            v_abs, _ = inputs.worst("v", 0, gcols)
            same = (f"read from the cache, v matches the reference (max_abs {fmt(v_abs)}), so the cache holds "
                    f"these tokens' keys,")
        else:
            kp_abs, _ = inputs.worst("k_pre_rope", 0, gcols)
            same = f"k_pre_rope matches the reference (max_abs {fmt(kp_abs)})"
        evidence = (f"layer {layer}, positions {span_text(lo, hi)}: {same} while k after RoPE differs "
                    f"(rel {fmt(k_rel)}), so the keys hold the same content rotated to other positions")
        details: dict = {"expected_positions": [lo, hi], "layer": layer}
        if fit is not None:
            enc, quality = fit[0][np.isin(positions[cols], group)], fit[1][np.isin(positions[cols], group)]
            offsets = enc - group
            if not offsets.any():
                log.debug("k differs after RoPE at %s, but rotated to the expected positions: not a position "
                          "mismatch", span_text(lo, hi))
                continue
            values, counts = np.unique(offsets, return_counts=True)
            offset = int(values[counts.argmax()])
            details.update(offset=offset, encoded_positions=[int(enc.min()), int(enc.max())],
                           fit_quality=float(quality.min()))
            evidence += (f"; the rotation angles fit encoded positions {span_text(int(enc[0]), int(enc[-1]))} "
                         f"(fit quality {fmt(float(quality.min()))}), expected {span_text(lo, hi)}: offset {offset:+d}")
            if values.size > 1:
                evidence += f" ({values.size} different offsets, {int(counts.max())} of {group.size} positions at {offset:+d})"
        else:
            details["offset"] = None
            evidence += "; RoPE frequencies could not be measured (the reference needs two consecutive positions)"
        reported = [inputs.chunks.encoded_position(int(p)) for p in group]
        if all(r is not None for r in reported):
            details["provenance_encoded_positions"] = [min(reported), max(reported)]
            evidence += f"; the candidate's provenance says it encoded them at {span_text(reported[0], reported[-1])}"
        out.append(Diagnosis("position_mismatch", chunk, (lo, hi), evidence, details))
    return out

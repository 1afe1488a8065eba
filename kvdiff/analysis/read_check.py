"""Whether the K/V a trace records are what attention read: a claim about them checked downstream.

A claim that a layer's keys or values differ from the reference's (cache_content_mismatch,
position_mismatch, rope_mismatch) is a claim about what attention read there. Attention at every
later position reads them (its mask is causal), so where its output at that layer matches the
reference's at every position computed from the claimed rows on, while those rows differ by far more
than rounding, attention did not read them as recorded: the trace holds other rows than attention
read (an adapter that recorded another layer's, position's or tensor's rows), and the claim says so,
with a confidence that no longer carries an engine bug.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from kvdiff.analysis.diagnosis import Diagnosis, DiagnosisInputs, span_text
from kvdiff.analysis.operation import attention_point

CLAIMS = ("cache_content_mismatch", "position_mismatch", "rope_mismatch")
LARGE = 1e-4             # a K/V difference this large (rel: about 1.4% of the rows' norm) moves attention's output
UNREAD_CONFIDENCE = 0.3  # at most, for a claim the attention output contradicts


def checked_reads(inputs: DiagnosisInputs, diagnoses: list[Diagnosis]) -> list[Diagnosis]:
    """`diagnoses`, each K/V claim that attention's own output contradicts marked so (`read_by_attention`
    false, the evidence saying why, confidence at most UNREAD_CONFIDENCE)."""
    return [_checked(inputs, d) if d.kind in CLAIMS else d for d in diagnoses]


def _checked(inputs: DiagnosisInputs, d: Diagnosis) -> Diagnosis:
    cmp = inputs.comparison
    layer, point = d.details.get("layer", inputs.first_layer), attention_point(cmp)
    if d.positions is None or layer not in cmp.layers or point not in cmp.points:
        return d
    row, al = cmp.layers.index(layer), cmp.alignment
    claimed = np.flatnonzero((al.positions >= d.positions[0]) & (al.positions <= d.positions[1]))
    differing = [inputs.worst(p, row, claimed)[1] for p in ("k", "v") if p in cmp.points]
    readers = np.flatnonzero(al.computed & al.comparable & (al.positions >= d.positions[0]))
    matches = inputs.ok(point, row)
    if not readers.size or not differing or not np.nanmax(differing) >= LARGE or not matches[readers].all():
        return d
    first, last = int(al.positions[readers[0]]), int(al.positions[readers[-1]])
    evidence = (f"{d.evidence}; but attention's output ({point}) at layer {layer} matches the reference at every "
                f"position computed from them on ({readers.size}, {span_text(first, last)}), although these rows "
                f"differ by up to rel {np.nanmax(differing):.3g}: attention did not read them as recorded, so the "
                f"trace holds other K/V than attention read (a recording mistake, such as an adapter's), and no "
                f"engine bug is shown here")
    proof = f"{d.proof}; {point} at layer {layer} within tolerance at all {readers.size} positions reading these rows"
    return replace(d, evidence=evidence, proof=proof, details={**d.details, "read_by_attention": False},
                   confidence=min(d.confidence if d.confidence is not None else 1.0, UNREAD_CONFIDENCE))

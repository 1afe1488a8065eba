"""Whether the rows a claim is about are what the next operation read: a claim checked downstream.

A claim that a layer's keys or values differ from the reference's (cache_content_mismatch,
position_mismatch, rope_mismatch, an operation_mismatch of k or v) is a claim about what attention
read there. Attention at every later position reads them (its mask is causal), so where its output
at that layer matches the reference's at every position computed from the claimed rows on, while
those rows differ by far more than rounding, attention did not read them as recorded: the trace
holds other rows than attention read (an adapter that recorded another layer's, position's or
tensor's rows), and the claim says so, with a confidence that no longer carries an engine bug. The
same holds for the rows one operation reads at the same position: q (attention's output there, at
a row that sees more than one key), k_pre_rope (k, its rotation), z (attn_out, o_proj's output:
an attention_mismatch or operation_mismatch of z whose attn_out matches), attn_out and mlp_out
(the residual add, or the post-norm, that takes them: resid_mid, resid_post), and a norm that does
not recompute from its recorded input (attn_norm read by q, mlp_norm by the MLP).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from kvdiff.analysis.compare import Comparison
from kvdiff.analysis.diagnosis import Diagnosis, DiagnosisInputs, span_text
from kvdiff.analysis.operation import attention_point
from kvdiff.analysis.tolerance import Tier

KV_CLAIMS = ("cache_content_mismatch", "position_mismatch", "rope_mismatch")
READ_LATER = ("k", "v", "kv_latent")        # read by attention at every later position too
NORM_READERS = {"attn_norm": "q", "mlp_norm": "mlp_out"}     # a layer's norm output, read at its own row
RESIDUAL_READERS = {"attn_out": ("attn_post_norm", "resid_mid"), "mlp_out": ("mlp_post_norm", "resid_post")}
LARGE = 1e-4             # a difference this large (rel: about 1.4% of the rows' norm) moves what reads it
UNREAD_CONFIDENCE = 0.3  # at most, for a claim the reading operation's output contradicts


def checked_reads(inputs: DiagnosisInputs, diagnoses: list[Diagnosis], whole: Comparison) -> list[Diagnosis]:
    """`diagnoses`, each claim that the reading operation's own output contradicts marked so
    (`read_by_attention` false for what attention reads, `read_downstream` false with `read_by`
    for any, the evidence saying why, confidence at most UNREAD_CONFIDENCE). `whole`: every row's
    comparison (a digest trace's, past its zoom window too), where later readers are read."""
    out = []
    for d in diagnoses:
        read = _reader(inputs, d)
        out.append(d if read is None else _checked(inputs, d, *read, whole))
    return out


def _reader(inputs: DiagnosisInputs, d: Diagnosis) -> tuple[tuple[str, ...], str, bool, int | None] | None:
    """(the claimed points, the point that reads them, whether later positions read them too, the
    claim's layer), or None where the claim is not one this checks."""
    cmp = inputs.comparison
    attention = attention_point(cmp)
    tensor, layer = d.details.get("tensor"), d.details.get("layer", inputs.first_layer)
    if d.kind in KV_CLAIMS:
        return tuple(p for p in ("k", "v") if p in cmp.points), attention, True, layer
    if d.kind == "operation_mismatch" and tensor in READ_LATER:
        return (tensor,), attention, True, layer
    if d.kind == "operation_mismatch" and tensor == "q":
        return ("q",), attention, False, layer
    if d.kind == "operation_mismatch" and tensor == "k_pre_rope":
        return ("k_pre_rope",), "k", False, layer
    if d.kind == "operation_mismatch" and tensor in RESIDUAL_READERS:
        post, add = RESIDUAL_READERS[tensor]
        return (tensor,), post if post in cmp.points else add, False, layer
    if attention == "z" and (d.kind == "attention_mismatch" and d.details.get("side") != "reference"
                             or d.kind == "operation_mismatch" and tensor == "z"):
        return ("z",), "attn_out", False, layer
    norm = d.details.get("candidate_inconsistent") or {}
    if d.kind == "norm_consistency" and norm.get("norm") in NORM_READERS and norm.get("layer") is not None:
        return (norm["norm"],), NORM_READERS[norm["norm"]], False, norm["layer"]
    return None


def _checked(inputs: DiagnosisInputs, d: Diagnosis, points: tuple[str, ...], reader: str, later: bool,
             layer: int | None, whole: Comparison) -> Diagnosis:
    cmp = inputs.comparison
    pmap = whole.points.get(reader)
    if d.positions is None or layer not in cmp.layers or pmap is None or layer not in pmap.layers or not points:
        return d
    row, al = cmp.layers.index(layer), cmp.alignment
    claimed = np.flatnonzero((al.positions >= d.positions[0]) & (al.positions <= d.positions[1]))
    differing = [inputs.worst(p, row, claimed)[1] for p in points if p in cmp.points]
    # the readers over every row, past the zoom window too (by their digests): later forwards read K/V
    # as the cache then held them, which may not be as the forward that wrote them recorded
    at, tiers = whole.alignment, pmap.tier[pmap.layers.index(layer)]
    readers = at.computed & at.comparable & (at.positions >= d.positions[0])
    if not later:           # the same rows; attention at a row that sees one key does not depend on its q
        readers &= (at.positions <= d.positions[1]) & (at.positions > (0 if points == ("q",) else -1))
    # digests whose bits differ by an unknown size (Tier.DIFFERENT) neither confirm nor refute
    readers = readers & (tiers != Tier.DIFFERENT)
    readers = np.flatnonzero(readers)
    matches = (tiers == Tier.BITWISE) | (tiers == Tier.NOISE)
    if not readers.size or not differing or not np.nanmax(differing) >= LARGE or not matches[readers].all():
        return d
    first, last = int(at.positions[readers[0]]), int(at.positions[readers[-1]])
    what = "K/V" if later else " and ".join(points)
    where = "from them on" if later else "there"
    evidence = (f"{d.evidence}; but {reader}, which reads them, at layer {layer} matches the reference at every "
                f"position computed {where} ({readers.size}, {span_text(first, last)}), although these rows differ "
                f"by up to rel {np.nanmax(differing):.3g}: they were not read as recorded, so the trace holds other "
                f"{what} than the engine used (a recording mistake, such as an adapter's), and no engine bug is shown "
                f"here")
    proof = f"{d.proof}; {reader} at layer {layer} within tolerance at all {readers.size} positions reading these rows"
    details = {**d.details, "read_downstream": False, "read_by": reader}
    if reader == attention_point(cmp):
        details["read_by_attention"] = False
    return replace(d, evidence=evidence, proof=proof, details=details,
                   confidence=min(d.confidence if d.confidence is not None else 1.0, UNREAD_CONFIDENCE))

"""expert_flip: a token routed to other experts than in the reference.

In a mixture-of-experts layer the router scores every expert and only the top k run, so where the
two runs choose different sets of experts for a token, that token's MLP output there comes from
other weights: the difference is no longer rounding. The first flip in dataflow order (position,
then layer: a flip only changes later layers and later positions) is named with the experts each
run chose and the reference router's margin there, the gap between the k-th and (k+1)-th of what
the router ranks to choose: its logits (softmax and top-k keep their order), or with DeepSeek's
routing each expert's sigmoid score plus the router's bias (the trace's router_bias), within the
groups the choice keeps (each group scored by its two best experts). A reordering of the same
experts is not a flip.

First, whether each run's choice follows its own logits: where a run's chosen experts are not a
top-k set of what its own router ranks (known: plain top-k, or DeepSeek's routing with its bias
recorded), the cause is `selection` (that run's top-k selection itself, its index or its rule,
computes otherwise; `side` names the run), whatever the logits did. Else what moved the logits is
read from the comparison at that cell, and says why it flipped:
- `near_tie`: the router's input (mlp_norm) and its logits are within tolerance: rounding noise
  larger than the margin chose another expert;
- `router`: the router's input matches and its logits break tolerance: the router itself
  computes otherwise (its weights, its precision);
- `upstream`: the router's input already breaks tolerance: the flip follows an earlier divergence.
The flip is observed in the recorded ids, not fitted: confidence 1.
"""

from __future__ import annotations

import numpy as np

from kvdiff.analysis.diagnosis import Diagnosis, DiagnosisInputs, fmt
from kvdiff.analysis.tolerance import Tier
from kvdiff.trace.format import ModelDims

_WHY = {
    "near_tie": "rounding noise larger than the margin flipped a near tie",
    "router": "the router itself computes otherwise (its input matches, its logits do not)",
    "upstream": "the flip follows the divergence before it (the router's input already differs)",
    "selection": "the selection itself differs (its top-k, its index or its rule), whatever the logits did",
}


def _tier(inputs: DiagnosisInputs, point: str, row: int, col: int) -> str:
    pmap = inputs.comparison.points.get(point)
    if pmap is None or pmap.tier[row, col] < 0:
        return "not compared"
    return Tier(int(pmap.tier[row, col])).label


def _flips(inputs: DiagnosisInputs) -> list[tuple[int, np.ndarray]]:
    """Per compared layer row: the aligned columns where the two runs chose different expert sets."""
    al = inputs.comparison.alignment
    compared = al.comparable & al.computed
    out = []
    for row, layer in enumerate(inputs.comparison.layers):
        ref, cand = inputs.rows(layer, "experts")
        differ = (np.sort(ref, axis=1) != np.sort(cand, axis=1)).any(axis=1)
        out.append((row, np.flatnonzero(differ & compared)))
    return out


def _choice_scores(logits: np.ndarray, bias: np.ndarray | None, dims: ModelDims) -> np.ndarray:
    """What the router ranks to choose, from one row of its logits: the logits; with DeepSeek's routing
    (and its bias recorded) sigmoid(logits) + bias in the `groups_chosen` best groups, -inf elsewhere."""
    if not dims.expert_groups or bias is None:
        return logits
    scores = 1.0 / (1.0 + np.exp(-logits)) + bias.astype(np.float64)
    groups = scores.reshape(dims.expert_groups, -1)
    best = np.argsort(-np.sort(groups, axis=1)[:, -2:].sum(axis=1), kind="stable")[:dims.groups_chosen]
    kept = np.zeros(dims.expert_groups, bool)
    kept[best] = True
    return np.where(np.repeat(kept, groups.shape[1]), scores, -np.inf)


def _top_k_set(scores: np.ndarray, ids: list[int]) -> bool | None:
    """Whether `ids` are a top-k set of `scores` (ties either way); None where an id names no expert."""
    if not ids or min(ids) < 0 or max(ids) >= scores.size or len(set(ids)) != len(ids):
        return None
    chosen = np.zeros(scores.size, bool)
    chosen[ids] = True
    return bool(chosen.all() or scores[chosen].min() >= scores[~chosen].max())


def _margin(scores: np.ndarray, k: int) -> float:
    """The gap between the k-th and the (k+1)-th largest score of a row (inf with no (k+1)-th)."""
    ranked = np.sort(scores.astype(np.float64))[::-1]
    return float(ranked[k - 1] - ranked[k]) if ranked.size > k and np.isfinite(ranked[k]) else float("inf")


def diagnose_expert_flip(inputs: DiagnosisInputs) -> list[Diagnosis]:
    """One expert_flip at the first token and layer whose chosen experts differ (none when the
    experts were not recorded in both traces or never differ)."""
    cmp = inputs.comparison
    if "experts" not in cmp.points or "router_logits" not in cmp.points:
        return []
    flips = [(row, cols) for row, cols in _flips(inputs) if cols.size]
    if not flips:
        return []
    row, col = min(((row, int(cols[0])) for row, cols in flips), key=lambda rc: (rc[1], rc[0]))
    layer = cmp.layers[row]
    position = int(cmp.alignment.positions[col])
    ref_ids, cand_ids = (ids[col].astype(np.int64).tolist() for ids in inputs.rows(layer, "experts"))
    ref_logits, cand_logits = (rows[col].astype(np.float64) for rows in inputs.rows(layer, "router_logits"))
    k, dims = len(ref_ids), inputs.reference.meta.dims
    ref_scores, cand_scores = (_choice_scores(logits, trace.router_bias(layer), dims) for logits, trace in
                               ((ref_logits, inputs.reference), (cand_logits, inputs.candidate)))
    margin, cand_margin = _margin(ref_scores, k), _margin(cand_scores, k)
    ranked = ("the logits" if not dims.expert_groups or inputs.reference.router_bias(layer) is None else
              "the choice scores (sigmoid of the logits plus the router's bias, within the best groups)")
    moved = float(np.abs(cand_logits - ref_logits).max())
    input_tier, logits_tier = _tier(inputs, "mlp_norm", row, col), _tier(inputs, "router_logits", row, col)
    matching = (Tier.BITWISE.label, Tier.NOISE.label)
    cause = ("upstream" if input_tier not in matching else "near_tie" if logits_tier in matching else "router")
    scored = not dims.expert_groups or all(t.router_bias(layer) is not None for t in (inputs.reference, inputs.candidate))
    departs = [(side, ids, scores) for side, ids, scores in (("candidate", cand_ids, cand_scores),
                                                            ("reference", ref_ids, ref_scores))
               if scored and _top_k_set(scores, ids) is False]
    selection = {}
    if departs:
        cause, (side, ids, scores) = "selection", departs[0]
        selection = {"side": side, "own_top_k": np.argsort(-scores, kind="stable")[:k].tolist()}
    sequence = inputs.sequence
    token = inputs.token_text(int(sequence[position])) if position < sequence.size else None
    cells = sum(cols.size for _, cols in flips)
    tokens = np.unique(np.concatenate([cols for _, cols in flips])).size
    why, own_text = _WHY[cause], ""
    if selection:
        own = f"its own router's {ranked.removeprefix('the ')}"
        why = f"the {selection['side']}'s chosen experts {ids} are not the top {k} of {own} ({selection['own_top_k']} are): {why}"
        own_text = f"; the {selection['side']}'s experts are not a top-{k} set of {own}"
    evidence = (f"layer {layer}, position {position}" + (f" {token!r}" if token is not None else "")
                + f": the router chose experts {ref_ids} in the reference and {cand_ids} here; the reference's "
                f"margin between {ranked} ranked {k} and {k + 1} was {fmt(margin)} and the router logits moved by up "
                f"to {fmt(moved)} (router input mlp_norm {input_tier}, router_logits {logits_tier}): {why}"
                f"; {cells} token-layer flip(s) in all, over {tokens} token(s) and {len(flips)} layer(s)")
    proof = (f"expert sets {sorted(ref_ids)} vs {sorted(cand_ids)} at layer {layer}, position {position}; reference "
             f"router margin {fmt(margin)}, largest logit change {fmt(moved)}; mlp_norm {input_tier}, router_logits "
             f"{logits_tier}{own_text}")
    return [Diagnosis("expert_flip", inputs.chunks.chunk_of(position), (position, position), evidence, {
        "layer": layer, "token": token, "reference_experts": ref_ids, "candidate_experts": cand_ids,
        "router_margin": margin, "candidate_router_margin": cand_margin, "router_logit_change": moved,
        "cause": cause, **selection, "flips": cells}, confidence=1.0, proof=proof)]

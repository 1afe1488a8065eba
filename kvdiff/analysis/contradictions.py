"""Which diagnoses contradict each other, and which contradict their own proof.

Two claims contradict when they explain the same positions in incompatible ways: the keys hold the
same content at other positions (position_mismatch) against other frequencies (rope_mismatch) or
other content (cache_content_mismatch); keys left out (missing_context) against attention computed
otherwise (attention_mismatch); two different offsets, unattended spans or explanations for the
same rows; everything within tolerance (numerical_noise) against any divergence. A claim
contradicts its own proof when the measurement it carries refutes it (an explanation that leaves
more of the difference than it may, a rotation that fits no integer position, an expert flip whose
logits moved too little to swap an expert, unless a run's choice does not follow its own logits, or
whose expert sets are the same). Works on
report.json's diagnosis objects; `consistent` keeps, of each contradicting pair, the claim with the
higher confidence.
"""

from __future__ import annotations

from typing import Any

from kvdiff.analysis.diagnosis import PRIORITY, Diagnosis

EXPLAINS = 0.5      # diagnose_context's bound on the share an explanation may leave unexplained

DIVERGENCES = ("position_mismatch", "rope_mismatch", "missing_context", "attention_mismatch", "cache_content_mismatch",
               "operation_mismatch", "expert_flip", "non_finite", "logits_mismatch")
_EXCLUSIVE = {frozenset(p) for p in (("position_mismatch", "rope_mismatch"),
                                     ("position_mismatch", "cache_content_mismatch"),
                                     ("rope_mismatch", "cache_content_mismatch"),
                                     ("missing_context", "attention_mismatch"))}
# Per kind, the fields two claims over the same positions must agree on.
_SAME = {"position_mismatch": ("offset",), "missing_context": ("unattended",), "attention_mismatch": ("side",
         "explanation", "scale_factor"), "rope_mismatch": ("scaling_factor", "base", "magnitude_factor")}


def _overlap(a: dict, b: dict) -> bool:
    pa, pb = a.get("positions"), b.get("positions")
    return bool(pa and pb and pa[0] <= pb[1] and pb[0] <= pa[1])


def _same_layer(a: dict, b: dict) -> bool:
    la, lb = a.get("layer"), b.get("layer")
    return la is None or lb is None or la == lb


def contradiction(a: dict, b: dict) -> str | None:
    """Why diagnoses `a` and `b` (report.json objects) contradict each other, or None."""
    ka, kb = a.get("kind"), b.get("kind")
    if "numerical_noise" in (ka, kb) and ({ka, kb} & set(DIVERGENCES)):
        return "numerical_noise says every compared row is within tolerance, the other a divergence"
    if not _overlap(a, b):
        return None
    if frozenset((ka, kb)) in _EXCLUSIVE and _same_layer(a, b) and not (a.get("cached") or b.get("cached")):
        return f"{ka} and {kb} explain the same positions in incompatible ways"
    if ka == kb and ka in _SAME and _same_layer(a, b) and bool(a.get("cached")) == bool(b.get("cached")):
        for key in _SAME[ka]:
            if a.get(key) != b.get(key):
                return f"two {ka} claims over the same positions with different {key}: {a.get(key)} vs {b.get(key)}"
    return None


def refuted(d: dict) -> str | None:
    """Why a diagnosis's own measurement refutes it (or it carries none), or None."""
    explained = d.get("kind") == "missing_context" and not d.get("cached") or d.get("explanation")
    if explained and d.get("fit_residual") is None:
        return "it names what attention left out or did otherwise without the recomputation that shows it"
    if explained and d["fit_residual"] > EXPLAINS:
        return f"its explanation leaves {d['fit_residual']:.3g} of the difference unexplained"
    if d.get("kind") == "position_mismatch" and (d.get("fit_quality") is None or d["fit_quality"] < 0.99):
        return f"its rotation fits the positions it names with quality {d.get('fit_quality')} only"
    if d.get("kind") == "expert_flip":
        if sorted(d.get("reference_experts") or ()) == sorted(d.get("candidate_experts") or ()):
            return "its two runs chose the same set of experts"
        if d.get("cause") != "selection" and 2 * d.get("router_logit_change", 0.0) < d.get("router_margin", 0.0):
            # swapping expert a out for b needs l_a - l_b >= margin closed by |change a| + |change b|
            return (f"its router logits moved by {d.get('router_logit_change'):.3g}, too little to close a margin "
                    f"of {d.get('router_margin'):.3g}")
    if d.get("proof") is None or d.get("confidence") is None:
        return "it carries no proof or confidence"
    if not 0 <= d["confidence"] <= 1:
        return f"confidence {d['confidence']} outside [0, 1]"
    return None


def contradictions(diagnoses: list[dict[str, Any]]) -> list[str]:
    """Every contradiction among report.json diagnosis objects, in words."""
    out = [f"{d['kind']} {d.get('positions')}: {why}" for d in diagnoses if (why := refuted(d))]
    for i, a in enumerate(diagnoses):
        for b in diagnoses[i + 1:]:
            why = contradiction(a, b)
            if why:
                out.append(f"{a['kind']} {a.get('positions')} vs {b['kind']} {b.get('positions')}: {why}")
    return out


def consistent(diagnoses: list[Diagnosis]) -> list[Diagnosis]:
    """The diagnoses without those refuted by their own measurement and, of each contradicting pair,
    the one with the lower confidence (then the later kind in PRIORITY)."""
    rank = {kind: i for i, kind in enumerate(PRIORITY)}
    key = lambda d: (-(d.confidence if d.confidence is not None else 0.0), rank.get(d.kind, len(PRIORITY)))
    kept: list[Diagnosis] = []
    for d in sorted(diagnoses, key=key):
        j = d.to_json()
        if refuted(j) or any(contradiction(j, k.to_json()) for k in kept):
            continue
        kept.append(d)
    return [d for d in diagnoses if any(d is k for k in kept)]

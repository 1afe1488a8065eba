"""norm_consistency: do differing norm statistics come from differing inputs or from the norm itself?"""

from __future__ import annotations

import numpy as np

from kvdiff.analysis.diagnosis import Diagnosis, DiagnosisInputs, fmt, span_text
from kvdiff.analysis.norm_fit import candidate_form, declared_difference
from kvdiff.analysis.norms import NormCheck
from kvdiff.analysis.tolerance import Tier
from kvdiff.errors import TraceError


def _where(check: NormCheck) -> str:
    return f"{check.norm}" if check.layer is None else f"layer {check.layer} {check.norm}"


def _inconsistent(checks: list[NormCheck], which: str, comparable: np.ndarray) -> tuple[NormCheck, int] | None:
    for c in checks:
        ok = getattr(c, f"{which}_consistent")
        if ok is not None and (~ok & comparable).any():
            return c, int(np.flatnonzero(~ok & comparable)[0])
    return None


def _rounded_inputs(check: NormCheck, differ: np.ndarray) -> np.ndarray:
    """Of the positions where `check`'s statistics differ, those whose inputs differ only within
    tolerance while both traces declare the same weight and eps and both recompute the norm
    exactly: the same function of slightly different inputs, so the inputs explain them too."""
    if not check.same_norm or check.ref_consistent is None or check.cand_consistent is None:
        return np.zeros_like(differ)
    return differ & (check.input_tier == Tier.NOISE) & check.ref_consistent & check.cand_consistent


def _rows_match(check: NormCheck, differ: np.ndarray) -> np.ndarray:
    """Of the positions where `check`'s statistics differ, those whose statistics are not of the rows
    recorded: a trace's statistics that are not its own rows' (another position's or tensor's), or,
    unexplained by rounding (`_rounded_inputs`), where the norm's input and output rows both match
    the reference's."""
    ok = lambda tier: (tier == Tier.BITWISE) | (tier == Tier.NOISE)
    own = [~of for of in (check.ref_stats_of_rows, check.cand_stats_of_rows) if of is not None]
    not_of_rows = np.logical_or.reduce(own) if own else np.zeros_like(differ)
    return differ & (not_of_rows | ~_rounded_inputs(check, differ) & ok(check.input_tier) & ok(check.output_tier))


def diagnose_norms(inputs: DiagnosisInputs) -> list[Diagnosis]:
    cmp = inputs.comparison
    checks, positions = cmp.norms, cmp.alignment.positions
    comparable = cmp.alignment.comparable & cmp.alignment.computed      # norms run only where K/V were computed
    if not checks:
        return []
    differ = [(c, (c.stats_differ if c.stats_differ is not None else c.output_tier == Tier.DIVERGENT) & comparable)
              for c in checks]
    n_differ = sum(int(d.sum()) for _, d in differ)
    recorded = [_rows_match(c, d) for c, d in differ]
    from_inputs = sum(int((d & (c.input_tier == Tier.DIVERGENT) & ~r).sum()) for (c, d), r in zip(differ, recorded))
    from_rounding = sum(int((_rounded_inputs(c, d) & ~r).sum()) for (c, d), r in zip(differ, recorded))
    rows_match = sum(int(r.sum()) for r in recorded)
    bad_ref = _inconsistent(checks, "ref", comparable)
    bad_cand = _inconsistent(checks, "cand", comparable)
    if n_differ == 0 and bad_cand is None and bad_ref is None:
        return []
    recomputed = [c for c in checks if c.cand_recompute_rel is not None]
    parts = []
    if recomputed:
        worst = max(float(np.fmax.reduce(np.where(comparable, c.cand_recompute_rel, 0.0), initial=np.nan))
                    for c in recomputed)
        parts.append(f"recomputing {len(recomputed)} norms of the candidate from their recorded inputs and weights "
                     f"gives max rel {fmt(worst)}")
    for name, bad in (("reference", bad_ref), ("candidate", bad_cand)):
        if bad is not None:
            c, col = bad
            parts.append(f"the {name}'s {_where(c)} does NOT match its recomputation at position {int(positions[col])}: "
                         f"the norm itself (weight, eps or kernel) is wrong there")
    form = None
    if bad_cand is not None:
        c = bad_cand[0]
        form = candidate_form(inputs.candidate, cmp.alignment, c, np.flatnonzero(~c.cand_consistent & comparable),
                              cmp.tolerances)
        if form is not None:
            parts.append(f"its rows there are {form.text}" + ("" if form.form == "precision" else
                         f" (every tested row within the recomputation's tolerance, rel up to {fmt(form.rel)})"))
    declared = _declared(inputs, checks)
    if declared is not None:
        parts.append(f"the candidate's trace declares another {_where(declared[0])} than the reference's: "
                     f"{declared[1]}")
    if n_differ:
        first_c, first_d = next((c, d) for c, d in differ if d.any())
        cols = np.flatnonzero(first_d)
        parts.append(f"norm statistics differ at {n_differ} (norm, position) pairs, first at {_where(first_c)} "
                     f"position {int(positions[cols[0]])}; {from_inputs} of {n_differ} have a differing input "
                     f"(RMSNorm is per token with no running statistics, so those follow from their inputs)")
        if from_rounding:
            parts.append(f"{from_rounding} more have inputs within tolerance but not equal, and both traces declare "
                         f"the same weight and eps and recompute their norms exactly: the same norm turns those "
                         f"small input differences into these")
        if rows_match:
            parts.append(f"{rows_match} differ where they are not the statistics of the rows the trace recorded "
                         f"(of its own norm input and output there, or where those match the reference's): those "
                         f"statistics were not taken of those rows (a recording mistake, such as an adapter's), not a "
                         f"norm that differs")
        if from_inputs + from_rounding + rows_match < n_differ:
            parts.append(f"{n_differ - from_inputs - from_rounding - rows_match} differ with matching inputs: the norm "
                         f"itself differs there")
    explained = from_inputs + from_rounding
    source = "norm" if bad_cand is not None or bad_ref is not None or explained + rows_match < n_differ else \
        "recording" if rows_match else "inputs"
    spots = np.flatnonzero(np.logical_or.reduce([d for _, d in differ]))
    if bad_cand is not None:
        spots = np.union1d(spots, [bad_cand[1]])
    span = (int(positions[spots[0]]), int(positions[spots[-1]])) if spots.size else None
    chunk = inputs.chunks.chunk_of(span[0]) if span else None
    evidence = "; ".join(parts) + ". Verdict: differences come from the " + \
        {"norm": "norm itself", "inputs": "inputs", "recording": "recording of the statistics"}[source] + "."
    if span:
        evidence = f"positions {span_text(*span)}: " + evidence
    if bad_cand is not None or bad_ref is not None:
        who, (c, col) = ("candidate", bad_cand) if bad_cand is not None else ("reference", bad_ref)
        proof = f"the {who}'s {_where(c)} at position {int(positions[col])} does not match w * x / sqrt(mean(x^2) + eps)"
    elif source == "norm":
        proof = f"{n_differ - explained} of {n_differ} differing norm statistics have inputs within tolerance"
    elif source == "recording":
        proof = f"{rows_match} of {n_differ} differing norm statistics have input and output rows within tolerance"
    else:
        proof = (f"{from_inputs} of {n_differ} differing norm statistics have a divergent input"
                 + (f", {from_rounding} an input within tolerance with the same weight and eps" if from_rounding else ""))
    return [Diagnosis("norm_consistency", chunk, span, evidence, confidence=1.0, proof=proof, details={
        "source": source, "stat_differences": n_differ, "explained_by_inputs": from_inputs,
        "explained_by_input_rounding": from_rounding, "rows_match": rows_match,
        "candidate_inconsistent": None if bad_cand is None else {"layer": bad_cand[0].layer, "norm": bad_cand[0].norm,
                                                                 "position": int(positions[bad_cand[1]])},
        "candidate_form": None if form is None else {"form": form.form, "value": form.value},
        "declared_difference": None if declared is None else {"layer": declared[0].layer, "norm": declared[0].norm,
                                                              "difference": declared[1]}})]


def _declared(inputs: DiagnosisInputs, checks: list[NormCheck]) -> tuple[NormCheck, str] | None:
    """The first norm whose weight or eps the two traces declare differently, and how."""
    for c in checks:
        if c.same_norm is False:
            try:
                text = declared_difference(inputs.reference.norm_weight(c.layer, c.norm),
                                           inputs.candidate.norm_weight(c.layer, c.norm))
            except TraceError:
                continue
            if text:
                return c, text
    return None

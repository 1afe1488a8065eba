"""Three-trace attribution: does a difference come from the engine itself or from its chunk strategy?

The baseline is the same engine with strategy `none` (no reuse). If the baseline already parts
from the reference at or before the place where the candidate does, the engine is the source;
if the baseline matches there, the chunk strategy is.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdiff.analysis.search import Location
from kvdiff.trace.points import POINT_ORDER


@dataclass(frozen=True)
class Attribution:
    source: str                           # "engine" | "strategy" | "none"
    evidence: str
    baseline_tokens_identical: bool
    baseline_first_divergence: Location | None
    baseline_first_bit_difference: Location | None

    def to_json(self) -> dict:
        loc = lambda x: None if x is None else x.to_json()
        return {"source": self.source, "evidence": self.evidence, "baseline_tokens_identical": self.baseline_tokens_identical,
                "baseline_first_divergence": loc(self.baseline_first_divergence),
                "baseline_first_bit_difference": loc(self.baseline_first_bit_difference)}


def _key(loc: Location, num_layers: int) -> tuple[int, int, int]:
    return loc.position, num_layers if loc.layer is None else loc.layer, POINT_ORDER[loc.tensor]


def _at(loc: Location) -> str:
    return f"{'final' if loc.layer is None else f'layer {loc.layer}'} position {loc.position} {loc.tensor}"


def attribute(candidate: Location | None, candidate_tokens_identical: bool, baseline: Location | None,
              baseline_bit: Location | None, baseline_tokens_identical: bool, num_layers: int,
              threshold: str) -> Attribution:
    """Compare where the candidate and the baseline first part from the reference (same `threshold`)."""
    def made(source: str, evidence: str) -> Attribution:
        return Attribution(source, evidence, baseline_tokens_identical, baseline, baseline_bit)

    if candidate is None and candidate_tokens_identical:
        return made("none", f"the candidate shows no {threshold} from the reference: nothing to attribute")
    if candidate is None:
        if not baseline_tokens_identical:
            return made("engine", "the candidate's tokens differ with every tensor within tolerance, and the baseline "
                                  "(strategy none) also changes tokens: the engine itself")
        return made("strategy", "the candidate's tokens differ with every tensor within tolerance, while the baseline "
                                "(strategy none) keeps the reference's tokens")
    if baseline is not None and _key(baseline, num_layers) <= _key(candidate, num_layers):
        return made("engine", f"the baseline (same engine, strategy none) already shows a {threshold} at {_at(baseline)}, "
                              f"at or before the candidate's at {_at(candidate)}: the engine itself, not the chunk strategy")
    base = "matches the reference everywhere" if baseline is None else f"first parts later, at {_at(baseline)}"
    return made("strategy", f"the candidate shows a {threshold} at {_at(candidate)} while the baseline (same engine, "
                            f"strategy none) {base}: the chunk strategy")

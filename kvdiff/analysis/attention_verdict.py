"""Which attention hypothesis explains the candidate's rows: scored, compared, and how strongly.

A hypothesis explains the tested rows when it leaves at most EXPLAINS of the change in attention's
output (z, or attn_out where the traces hold no z) unexplained and at most MARGIN of what its rival
(the best other explanation) leaves; against a span of hidden keys that overlaps its own (the same
span with other ends, which the data separate by the keys at the ends only) at most NESTED_MARGIN,
or just less where its span is exactly the positions before the rows' chunk (the chunk table says
so too). Equal residuals (one prediction) are one explanation: the simplest is named, and the
others of another kind are said to predict the same (`tied`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from kvdiff.analysis.attention_fit import UNRECORDED, AttentionTest, RecordedOutput, Score
from kvdiff.analysis.attention_hypotheses import (SOFTCAP_HI, finalists, fit_scale, fit_sinks, fit_softcap, fit_window,
                                                  hidden_span, hypotheses, moved_blocks)
from kvdiff.analysis.attention_search import grown_span, scanned_key, zeroed_span
from kvdiff.analysis.contradictions import EXPLAINS
from kvdiff.analysis.diagnosis import DiagnosisInputs, fmt

# an explanation leaves at most EXPLAINS of the change in the output unexplained (contradictions.py refutes more)
MARGIN = 0.5        # and at most this share of what the next-best explanation leaves,
NEAR_EXACT = 1e-2   # what an explanation that fits the rows leaves (float32 recomputation: ~1e-6 to 1e-3)
NESTED_MARGIN = 0.8  # or, where that one hides an overlapping span (one key more or less at an end), this
_PREFER = ("standard", "hidden", "scale", "next key", "chunk alone", "not causal", "no window", "window",
           "own key hidden", "kv heads", "softcap", "no sinks", "sinks scaled", "not cached", "zeroed", "kv swapped", "lagged mask",
           "shifted writes", "moved block")


def _nested(a: Score, b: Score) -> bool:
    """Both hide one span of keys and the spans overlap: the data separate them by the keys at their ends only."""
    x, y = a.hypothesis.hidden, b.hypothesis.hidden
    return x is not None and y is not None and x[0] <= y[1] and y[0] <= x[1]


@dataclass
class Verdict:
    best: Score
    standard: Score
    test: AttentionTest
    others: list                # every other explanation, best first
    aligned: bool               # the best hides exactly the positions before its rows' chunk (the chunk table's)
    tied: list = field(default_factory=list)   # other kinds of explanation predicting the same rows
    split: str | None = None    # how rows past the first token flip told tied explanations apart
    shared: bool = False        # the reference's own rows fit the best as well: not what differs
    side: str = "candidate"     # whose attention the hypotheses were tested on ("reference": explain_reference)

    @property
    def rival(self) -> Score | None:
        """The best other explanation that is not the best's span with other ends."""
        return next((o for o in self.others if not _nested(self.best, o)), None)

    @property
    def boundary(self) -> Score | None:
        """The best overlapping span, where the best hides a span."""
        return next((o for o in self.others if _nested(self.best, o)), None)

    @property
    def decisive(self) -> bool:
        rival, boundary = self.rival, self.boundary
        return (not self.shared and self.best.residual <= EXPLAINS
                and (rival is None or self.best.residual <= MARGIN * rival.residual)
                and (boundary is None or self.best.residual <= (1.0 if self.aligned else NESTED_MARGIN) * boundary.residual))

    @property
    def confidence(self) -> float:
        """The share of the change explained, times how far the best stands from its rival."""
        share, rival = 1.0 - self.best.residual, self.rival
        if rival is not None and np.isfinite(rival.residual) and rival.residual > 0:
            share *= 1.0 - self.best.residual / rival.residual
        return float(min(max(share, 0.0), 1.0))

    def fields(self) -> dict:
        rival, boundary = self.rival, self.boundary
        out = {"fit_residual": self.best.residual, "next_best": None if rival is None else rival.hypothesis.text,
               "next_best_residual": None if rival is None else rival.residual}
        if boundary is not None and boundary.residual < 2 * self.best.residual:
            out.update(boundary_alternative=list(boundary.hypothesis.hidden), boundary_residual=boundary.residual)
        if self.tied:
            out["same_prediction"] = [t.hypothesis.text for t in self.tied]
        return out

    def proof(self) -> str:
        fit = self.test.fit
        o_proj = ("compared with the attention output both traces recorded before o_proj (z)"
                  if isinstance(fit, RecordedOutput) else
                  f"o_proj (not recorded) determined by the reference's {fit.rows} rows, which span all {fit.dim} "
                  f"dimensions of its input" if fit.exact else
                  f"o_proj (not recorded) fitted: the reference's {fit.rows} rows span {fit.rank} of its {fit.dim} "
                  f"input dimensions, the rest from the other tested rows, each row predicted from the others")
        rest = "".join(f"; {label}, {o.hypothesis.text}: {fmt(o.residual)}" for label, o in
                       (("next best", self.rival), ("best overlapping span", self.boundary)) if o is not None)
        if self.best.hypothesis.name != "standard" and self.standard not in (self.rival, self.boundary):
            rest += f"; {self.standard.hypothesis.text}: {fmt(self.standard.residual)}"
        if self.tied:
            rest += ("; the same prediction at these rows (the data do not tell them apart; the simplest is named): "
                     + "; ".join(t.hypothesis.text for t in self.tied))
        if self.split:
            rest += f"; {self.split}"
        return (f"the {self.side}'s attention recomputed from its own q, k and v at {self.test.rows.size} rows: "
                f"{self.best.hypothesis.text} leaves {fmt(self.best.residual)} of the change in {self.test.point} unexplained "
                f"(median per row {fmt(self.best.median)}){rest}; {o_proj}")


def explain(tests: list[tuple[AttentionTest, str]], inputs: DiagnosisInputs) -> Verdict:
    """Score every hypothesis on each variant of the test (q as recorded; q rotated to its keys'
    frame), and pick the one that explains the rows best."""
    positions = inputs.comparison.alignment.positions
    first = int(positions[tests[0][0].rows[0]])
    starts = sorted({s[0] for s in (inputs.chunks.span(int(p)) for p in positions) if s is not None})
    prov, cand_pos = inputs.chunks.provenance, inputs.chunks.positions

    def chunk_start(col: int) -> int | None:
        span = inputs.chunks.span(int(positions[col]))
        return None if span is None else int(np.searchsorted(positions, span[0]))

    def same_forward_at(pa: int, pb: int) -> bool:
        """Positions `pa` and `pb` computed in one forward of the candidate (its provenance, else one chunk)."""
        if prov is not None:
            ia, ib = np.searchsorted(cand_pos, pa), np.searchsorted(cand_pos, pb)
            if ib < cand_pos.size and prov.prefill_id[ia] >= 0 and prov.prefill_id[ib] >= 0:
                return bool(prov.prefill_id[ia] == prov.prefill_id[ib])
        return inputs.chunks.chunk_of(pa) == inputs.chunks.chunk_of(pb)

    def same_forward(a: int, b: int) -> bool:
        return same_forward_at(int(positions[a]), int(positions[b]))

    ends: set[int] = set()                 # one past the last column of a forward already walked
    reach: dict[int, int] = {}             # column -> forward_end(column): each row's hypothesis asks again

    def forward_end(col: int) -> int:
        """One past the last column of `col`'s forward, over consecutive positions (at least col + 1);
        UNRECORDED where the forward goes on past the recorded columns (a zoom window's end)."""
        if col in reach:
            return reach[col]
        end = next((e for e in ends if e > col and same_forward(col, e - 1)), col + 1)
        while end < positions.size and positions[end] == positions[end - 1] + 1 and same_forward(col, end):
            end += 1
        ends.add(end)
        after = int(positions[end - 1]) + 1
        recorded = end < positions.size and positions[end] == after
        reach[col] = UNRECORDED if not recorded and same_forward_at(int(positions[col]), after) else end
        return reach[col]

    family = hypotheses(first, starts + [s - 1 for s in starts], chunk_start, same_forward, forward_end,
                        tests[0][0].cand.dims[:2], tests[0][0].heads, sinks=tests[0][0].cand.sinks is not None,
                        window=tests[0][0].window)
    scores, owner = [], {}

    def score_each_test(score) -> None:
        for test, note in tests:
            found = score(test, note)
            owner.update({id(f): test for f in found})
            scores.extend(found)

    score_each_test(lambda test, note: _scores(test, family, note))
    best, ties, others = _ranked(scores)
    if best.residual > NEAR_EXACT:          # nothing explains the rows exactly: is a cache block read in another's place?
        score_each_test(lambda test, note: _finalist_scores(test, moved_blocks(first), note))
        best, ties, others = _ranked(scores)
    if best.residual > NEAR_EXACT:          # or keys in the middle of the context hidden, or read as zeros
        scores.extend(_searched(tests[0][0], scores, first - 1, owner))
        best, ties, others = _ranked(scores)
    aligned = any(s.hypothesis.name == "chunk alone" for s in ties) and best.hypothesis.name == "hidden"
    tied = [s for s in ties if s.hypothesis.name not in (best.hypothesis.name, "chunk alone")]
    split = _past_flip(inputs, owner[id(best)], [best] + tied) if tied else None
    if split is not None:
        best, text = split
        return Verdict(best, scores[0], owner[id(best)], others, False, [], text)
    return Verdict(best, scores[0], owner[id(best)], others, aligned, tied[:3],
                   shared=_reference_shares(owner[id(best)], best, scores[0]))


def _searched(test: AttentionTest, scores: list[Score], last: int, owner: dict) -> list[Score]:
    """attention_search's answers on `test`: the span grown from the scanned key and from the best
    span tried, each also read as zero rows, where not already scored (`owner` told their test)."""
    tried = {s.hypothesis.hidden for s in scores if s.hypothesis.name == "hidden"}
    spans = [s for s in scores if s.hypothesis.name == "hidden" and np.isfinite(s.residual)]
    starts = [(key, key) for key in [scanned_key(test, last)] if key is not None]
    starts += [min(spans, key=lambda s: s.residual).hypothesis.hidden] if spans else []
    found = []
    for grown in {grown_span(test, start, last).hypothesis.hidden for start in starts} - tried:
        found += [test.score(hidden_span(*grown)), test.score(zeroed_span(*grown))]
    owner.update({id(s): test for s in found})
    return found


def _scores(test: AttentionTest, family: list, note: str = "") -> list[Score]:
    """Every finalist of `family` and the fitted scale, soft-cap and sliding window (where they move from
    the model's, and the window is not one of the family's) scored on `test`, the standard first."""
    found = _finalist_scores(test, family, note)
    scale, cap, window = fit_scale(test), fit_softcap(test), fit_window(test)
    sinks = fit_sinks(test) if test.cand.sinks is not None else None
    tried = {h.window for h in family if h.name == "window"}
    fitted = [f for f, kept in ((scale, abs(np.log(scale.hypothesis.scale)) >= 0.01),
                                (cap, cap.hypothesis.softcap < 0.9 * SOFTCAP_HI),
                                (window, window.hypothesis.window not in tried),
                                (sinks, sinks is not None and abs(np.log(sinks.hypothesis.sinks)) >= 0.01)) if kept]
    return found + [Score(replace(f.hypothesis, text=f.hypothesis.text + note), f.residual, f.median) for f in fitted]


def _finalist_scores(test: AttentionTest, family: list, note: str = "") -> list[Score]:
    """The finalists of `family` scored on `test`, `note` added to their texts."""
    return [test.score(replace(h, text=h.text + note)) for h in finalists(test, family)]


def _ranked(scores: list[Score]) -> tuple[Score, list[Score], list[Score]]:
    """The best (the simplest of those with the least residual), its ties, and the others best first."""
    ordered = sorted(scores, key=lambda s: s.residual)
    ties = [s for s in ordered if np.isclose(s.residual, ordered[0].residual, rtol=1e-9, atol=0)]
    best = min(ties, key=lambda s: _PREFER.index(s.hypothesis.name))
    return best, ties, [s for s in ordered if s not in ties]


def explain_reference(test: AttentionTest, first: int) -> Verdict | None:
    """Where the candidate's rows are its own q, k and v attended as the model does and the traces hold
    z: the same hypotheses tested on the reference's rows against its own z (the reference is then the
    run whose attention departs, such as a cold run in a cold-vs-warm compare). None where the
    reference's z misses its own standard attention by no more than rounding does (SHARED_MISS) or
    than OWN_MARGIN times what the candidate's misses (both computed in a narrow format)."""
    if test.point != "z":
        return None
    rev = AttentionTest(test.cand, test.ref, test.rows, RecordedOutput(), heads=test.heads, window=test.window)
    # the reference's forwards are not known here: no hypothesis spans a forward or a chunk
    family = hypotheses(first, [], lambda col: None, lambda a, b: False, lambda col: col + 1,
                        test.ref.dims[:2], test.heads, window=test.window)
    scores = _scores(rev, family)
    standard = next(s for s in scores if s.hypothesis.name == "standard")
    if rev.own_miss(standard.hypothesis) <= max(SHARED_MISS, OWN_MARGIN * test.own_miss(standard.hypothesis)):
        return None
    best, ties, others = _ranked(scores)
    tied = [s for s in ties if s.hypothesis.name != best.hypothesis.name]
    return Verdict(best, standard, rev, others, False, tied[:3], side="reference")


def _reference_shares(test: AttentionTest, best: Score, standard: Score) -> bool:
    """With z recorded: whether the reference's own rows depart from the standard attention the way
    `best` says the candidate's do (the standard misses more than rounding of their z, SHARED_MISS,
    and `best` fits them as well as it fits the candidate's: at most SHARED_MISS, or OWN_MARGIN times
    what it misses of the candidate's): then both runs compute attention so, and it is not what
    differs between them. A reference that departs otherwise (a window one key wider) does not share it."""
    if test.point != "z" or best.hypothesis.name == "standard":
        return False
    own = AttentionTest(test.ref, test.ref, test.rows, RecordedOutput(), heads=test.heads, window=test.window)
    standard_miss, miss = own.own_miss(standard.hypothesis), own.own_miss(best.hypothesis)
    return bool(standard_miss > SHARED_MISS and miss <= max(SHARED_MISS, OWN_MARGIN * test.own_miss(best.hypothesis)))


PAST_FLIP_ROWS = 8      # the candidate's rows past the first token flip a tie is tested on
OWN_MISS = 1e-2         # the most of those rows' own z an explanation may miss
SHARED_MISS = 1e-4      # a reference's z its own q, k and v miss by more than rounding does
OWN_MARGIN = 4.0        # and by this many times what the candidate's own z misses, to be the side that departs


def _past_flip(inputs: DiagnosisInputs, test: AttentionTest, tied: list[Score]) -> tuple[Score, str] | None:
    """Where the traces hold z and the tokens flipped: the one of `tied` (one prediction on the
    compared rows) that the candidate's own next rows past the flip single out (it misses at most
    OWN_MISS of their z, and at most MARGIN of what the others miss), with the measurement; else None."""
    al = inputs.comparison.alignment
    if test.point != "z" or al.comparable_until is None:
        return None
    n = test.cand.q.shape[0]
    cols = np.flatnonzero(~al.comparable & al.computed)
    cols = cols[(cols < n) & (al.positions[cols] == cols)][:PAST_FLIP_ROWS]
    if not cols.size:
        return None
    own = test.on(cols, PAST_FLIP_ROWS)
    (m0, s0), (m1, s1) = sorted(((own.own_miss(s.hypothesis), s) for s in tied), key=lambda x: x[0])[:2]
    if not (m0 <= OWN_MISS and m0 <= MARGIN * m1):
        return None
    return s0, (f"the candidate's own rows past the first token flip ({cols.size}, which the reference has no row to "
                f"compare with) tell them apart: {s0.hypothesis.text} misses {fmt(m0)} of their z, "
                f"{s1.hypothesis.text} {fmt(m1)}")

"""Searches past the attention hypotheses' fixed family, tried where nothing in it explains the rows:
one hidden key found by scanning every key at once, a span of hidden keys grown from the best one,
and the same span read as zero rows (K/V never written) instead of left out.

Hiding key j from a row's softmax turns its output z into (z - w_j v_j) / (1 - w_j), w_j the key's
weight (per head): every key's prediction comes from one softmax a row, so a key deep in a long
context (which the family samples) is found without scoring a hypothesis per key.
"""

from __future__ import annotations

import numpy as np

from kvdiff.analysis.attention_fit import QUICK_ROWS, AttentionTest, Hypothesis, Score, causal, in_window
from kvdiff.analysis.attention_hypotheses import hidden_span, span_text


def scanned_key(test: AttentionTest, last: int) -> int | None:
    """The key of 0..`last` whose hiding best predicts the candidate's z at a few tested rows (with z
    recorded; None without it, or with no key to scan)."""
    if test.point != "z" or last < 0:
        return None
    cand, quick = test.cand, test.on(test.rows, QUICK_ROWS)
    heads, _, d = cand.dims
    head_of = np.empty(heads, np.int64)
    for g, group in cand.groups():
        head_of[group] = g
    total = np.zeros(last + 1)
    for r in (int(r) for r in quick.rows):
        keys = min(last, r) + 1
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            s = np.where(causal(r, r + 1) & in_window(r, r + 1, test.window), test.scores(r, r + 1) * cand.scale,
                         -np.inf)
            w = np.exp(s - s.max(axis=1, keepdims=True))
            w /= w.sum(axis=1, keepdims=True)
            v = cand.v[:r + 1][:, head_of].astype(np.float64)                    # (keys, heads, d)
            z = np.einsum("hj,jhd->hd", w, v)
            hidden = (z[None] - w[:, :keys].T[..., None] * v[:keys]) / (1 - w[:, :keys].T)[..., None]
            err = ((hidden - cand.out[r].reshape(heads, d)[None]) ** 2).sum(axis=(1, 2))
        total[:keys] += np.where(np.isfinite(err), err, np.inf)
        total[keys:] = np.inf
    return int(np.argmin(total)) if np.isfinite(total).any() else None


def grown_span(test: AttentionTest, start: tuple[int, int], last: int) -> Score:
    """The span of hidden keys within 0..`last` that explains the rows best, grown from `start` (the best
    the family tried, or the scanned key: one key of a hole in the middle, say) by steps of 16 to 1
    at either end."""
    quick, seen = test.on(test.rows, QUICK_ROWS), {}

    def left(span: tuple[int, int]) -> float:
        if span not in seen:
            seen[span] = quick.score(hidden_span(*span)).residual
        return seen[span]

    lo, hi = start
    for step in (16, 8, 4, 2, 1):
        while (better := next(((a, b) for a, b in ((lo - step, hi), (lo + step, hi), (lo, hi - step), (lo, hi + step))
                               if 0 <= a <= b <= last and left((a, b)) < left((lo, hi))), None)) is not None:
            lo, hi = better
    return test.score(hidden_span(lo, hi))


def zeroed_span(lo: int, hi: int) -> Hypothesis:
    """Keys lo..hi read as zero rows (K and V: score 0, nothing added): cache rows never written."""
    return Hypothesis("zeroed", f"the keys at positions {span_text(lo, hi)} read as zero rows (K and V): their cache "
                      f"rows never written, or an empty block read in their place", causal,
                      zeroed=lambda row, n: (np.arange(n) >= lo) & (np.arange(n) <= hi) & (np.arange(n) < row),
                      since=lo)

"""Attention hypotheses tested on what the traces recorded (issue #27).

A hypothesis says how the candidate computed its attention from its own recorded q, k and v: the
model's causal softmax (within the layer's sliding window, where the trace declares one), with some
keys hidden, with another softmax scale, with the next key visible too. It predicts the candidate's
attention output before o_proj. Where the traces recorded that output (`z`), every tested row is an
exact test. Traces without it hold o_proj's output (`attn_out`) only, and not o_proj, which is
linear and the same in both traces: the reference's rows (its attention recomputed from its own q,
k, v, against the attn_out it recorded) determine it on the span of their attention outputs, the
whole space for a prompt at least heads x head_dim long (an exact test). Where they do not, the
candidate's other rows under the same hypothesis fit the rest, each tested row predicted from all
the others (leave-one-out, so a row never vouches for itself). A hypothesis is scored by the share
of the candidate's change (its attn_out minus the reference's) the prediction leaves unexplained:
`residual` 0 explains the rows exactly, 1 explains nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

# Rows tested per hypothesis, and reference rows fitted beyond heads x head_dim: bounds the work on
# long prompts (the fit needs no more; every tested row is a full softmax over its keys).
MAX_ROWS = 32
EXTRA_FIT_ROWS = 16
# Rows a first pass ranks every hypothesis on; the best few are then scored on all tested rows.
QUICK_ROWS = 8
# A hypothesis's reach past the keys a trace recorded: it cannot be tested (it scores no fit).
UNRECORDED = 1 << 62


@dataclass(frozen=True)
class Hypothesis:
    """One way the candidate may have attended: `visible(test_row, n_keys) -> bool (n_keys,)` over
    key rows 0..n_keys-1 (n_keys = its own row + 2 where a next key exists, or `reach(test_row)`
    where the hypothesis reads further), and a scale factor."""

    name: str                                  # its kind: one of attention_verdict._PREFER
    text: str                                  # in words, for the evidence
    visible: Callable[[int, int], np.ndarray]
    scale: float = 1.0
    hidden: tuple[int, int] | None = None      # the hidden key span, where one span for every row
    reach: Callable[[int], int] | None = None  # key rows read at a row, where more than the test's n_keys
    window: int | None = None                  # a sliding window: the keys a row sees, its own included
    kv_heads: tuple[int, ...] | None = None    # the KV head each query head reads, where not the model's groups
    softcap: float | None = None               # scaled scores s -> softcap * tanh(s / softcap) before the softmax
    zeroed: Callable[[int, int], np.ndarray] | None = None   # keys read as zero rows (K and V) at a row
    since: int | None = None                   # "zeroed", "not cached": the first key row they concern
    own_zeroed: bool = False                   # "zeroed": the row's own key read as zero too
    swapped: bool = False                      # K and V in each other's place: scores from v, values from k
    lag: int | None = None                     # "lagged mask": each row sees the keys up to its position minus lag
    # "shifted writes": at a row, the key row each cache slot 0..row holds (-1: never written, a zero row)
    moved: Callable[[int], np.ndarray] | None = None
    shift: int | None = None                   # "shifted writes": row r's K/V written at slot r + shift
    block: tuple | None = None                 # "moved block": (block size, slots (first, last), rows held (first, last))
    sinks: float | None = 1.0                  # the rows' sink logits in the softmax times this (None: left out)
    own_window: bool = False                   # `visible` replaces the layer's sliding window (its own, or none)

    def fields(self) -> dict:
        """What a report says of this explanation beside its name: its fitted or chosen values."""
        by_name = {"scale": {"scale_factor": self.scale}, "window": {"window": self.window},
                   "kv heads": {"kv_head_of_query_head": list(self.kv_heads or ())}, "softcap": {"softcap": self.softcap},
                   "zeroed": {"since": self.since, "own_key_zeroed": self.own_zeroed},
                   "not cached": {"since": self.since}, "lagged mask": {"mask_lag": self.lag}, "sinks scaled":
                   {"sink_scale": self.sinks},
                   "shifted writes": {"since": self.since, "write_shift": self.shift},
                   "moved block": {} if self.block is None else
                   {"block_size": self.block[0], "slots": list(self.block[1]), "holds": list(self.block[2])}}
        return by_name.get(self.name, {})


@dataclass
class Score:
    hypothesis: Hypothesis
    residual: float                            # ||unexplained|| / ||change|| over the tested rows
    median: float                              # the same per row, median


@dataclass
class AttentionRows:
    """One trace's rows of one layer at increasing positions 0..n-1 (row i = position i)."""

    q: np.ndarray                              # (n, heads, d); rows it did not compute are never read
    k: np.ndarray                              # (n, kv_heads, d)
    v: np.ndarray                              # (n, kv_heads, dv): dv is d but with latent attention
    out: np.ndarray                            # (n, hidden) attn_out, or (n, heads * dv) z
    scale: float
    sinks: np.ndarray | None = None            # (n, heads) attention sinks' logits, as attention applied them

    @property
    def dims(self) -> tuple[int, int, int]:
        return self.q.shape[1], self.k.shape[1], self.q.shape[2]

    def groups(self, kv_heads: tuple[int, ...] | None = None) -> list[tuple[int, np.ndarray]]:
        """(KV head, the query heads reading it): the model's consecutive groups, or `kv_heads`' map."""
        heads, kv, _ = self.dims
        if kv_heads is None:
            return [(g, np.arange(g * (heads // kv), (g + 1) * (heads // kv))) for g in range(kv)]
        return [(g, np.flatnonzero(np.asarray(kv_heads) == g)) for g in range(kv)]

    def raw_scores(self, row: int, n_keys: int, kv_heads: tuple[int, ...] | None = None) -> np.ndarray:
        """q k^T of `row` against key rows 0..n_keys-1, per head, unscaled, float64 (heads, n_keys).
        One kv group at a time, from the float32 rows: no copy of the keys (memory stays flat)."""
        out = np.empty((self.dims[0], n_keys))
        for g, heads in self.groups(kv_heads):
            q = self.q[row, heads].astype(np.float64)
            out[heads] = q @ self.k[:n_keys, g, :].T.astype(np.float64, copy=False)
        return out

    def attend(self, row: int, raw: np.ndarray, visible: np.ndarray, scale: float, softcap: float | None = None,
               kv_heads: tuple[int, ...] | None = None, zeroed: np.ndarray | None = None,
               values: np.ndarray | None = None, sinks: float | None = 1.0) -> np.ndarray:
        """Softmax over the visible keys, times v: the attention output before o_proj, (heads * dv,). `zeroed`
        keys read as zero rows (score 0, no value added); `values`: the v row each key reads (default its own);
        `sinks`: times each head's sink logit (None: none), one more term of the softmax's denominator."""
        heads, d, n = self.q.shape[1], self.v.shape[2], raw.shape[1]
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            s = raw * (self.scale * scale)
            if zeroed is not None:
                s[:, zeroed] = 0.0
            s = np.where(visible[None, :], s if softcap is None else softcap * np.tanh(s / softcap), -np.inf)
            sink = self.sinks[row].astype(np.float64) * sinks if sinks is not None and self.sinks is not None else None
            top = s.max(axis=1, keepdims=True) if sink is None else np.maximum(s.max(axis=1), sink)[:, None]
            s -= top
            w = np.exp(s)
            w /= w.sum(axis=1, keepdims=True) + (0.0 if sink is None else np.exp(sink[:, None] - top))
            if zeroed is not None:
                w[:, zeroed] = 0.0
            z = np.empty((heads, d))
            v = self.v[:n] if values is None else self.v[values]
            for g, group in self.groups(kv_heads):
                z[group] = w[group] @ v[:, g, :].astype(np.float64, copy=False)
        return z.reshape(heads * d)


class OProjFit:
    """o_proj as the reference's rows determine it: exact on the span of their attention outputs,
    and on the rest fitted, per hypothesis, from the candidate's other tested rows."""

    def __init__(self, z: np.ndarray, out: np.ndarray, noise: float):
        u, s, vt = np.linalg.svd(z, full_matrices=False)
        keep = s > s[0] * noise if s.size and s[0] > 0 else np.zeros(s.size, bool)
        self.basis = vt[keep].T                                                 # (D, r)
        self.w = self.basis @ ((u[:, keep].T @ out) / s[keep][:, None])          # (D, hidden): z @ w = prediction
        self.rank, self.dim, self.rows = int(keep.sum()), z.shape[1], z.shape[0]

    @property
    def exact(self) -> bool:
        return self.rank == self.dim

    def unexplained(self, z: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Per tested row, attn_out minus its prediction from the reference's rows and the other
        tested rows (leave-one-out ridge on the part the reference's rows do not span)."""
        y = out - z @ self.w
        if self.exact:
            return y
        x = z - (z @ self.basis) @ self.basis.T
        gram = x @ x.T
        ridge = 1e-9 * max(float(np.trace(gram)) / max(len(z), 1), 1e-300)
        inv = np.linalg.inv(gram + ridge * np.eye(len(z)))
        return (inv @ y) / np.diag(inv)[:, None]


class RecordedOutput:
    """No o_proj to fit: the traces recorded attention's output before it (z)."""

    exact = True

    def unexplained(self, z: np.ndarray, out: np.ndarray) -> np.ndarray:
        return out - z


@dataclass
class AttentionTest:
    """Hypotheses scored on the candidate's `rows` (row indices = positions)."""

    ref: AttentionRows
    cand: AttentionRows
    rows: np.ndarray                            # tested candidate rows (computed there, the output differs)
    fit: OProjFit | RecordedOutput
    raw: dict = field(default_factory=dict, repr=False)   # row -> q k^T (float32), shared by `on`
    heads: np.ndarray | None = None             # with z recorded: the query heads compared, where only they differ
    window: int | None = None                   # the layer's sliding window, as the model declares it

    @property
    def point(self) -> str:
        """The recorded output the hypotheses are tested against."""
        return "z" if isinstance(self.fit, RecordedOutput) else "attn_out"

    @classmethod
    def build(cls, ref: AttentionRows, cand: AttentionRows, rows: np.ndarray, noise: float,
              recorded: bool = False, window: int | None = None) -> "AttentionTest | None":
        """The test on `rows`; `recorded`: the rows' `out` is z (attention's output before o_proj);
        `window`: the layer's sliding window."""
        if recorded:
            return cls(ref, cand, cap_rows(rows), RecordedOutput(), window=window)
        heads, n = ref.q.shape[1], ref.q.shape[0]
        fit_rows = np.arange(min(n, heads * ref.v.shape[2] + EXTRA_FIT_ROWS))    # the earliest: the fewest keys to attend
        z = np.stack([ref.attend(r, ref.raw_scores(r, r + 1), in_window(r, r + 1, window), 1.0) for r in fit_rows])
        out = ref.out[fit_rows].astype(np.float64)
        finite = np.isfinite(z).all(axis=1) & np.isfinite(out).all(axis=1)      # NaN is non_finite's finding
        if not finite.any():
            return None
        return cls(ref, cand, cap_rows(rows), OProjFit(z[finite], out[finite], noise), window=window)

    def on(self, rows: np.ndarray, most: int = MAX_ROWS) -> "AttentionTest":
        """The same test (o_proj fit, q k^T computed so far) on other candidate rows (at most `most`)."""
        return AttentionTest(self.ref, self.cand, cap_rows(rows, most), self.fit, self.raw, self.heads, self.window)

    def compared(self, x: np.ndarray) -> np.ndarray:
        """Rows (n, heads * dv) of attention outputs: the columns of the heads compared."""
        if self.heads is None:
            return x
        return x.reshape(x.shape[0], self.cand.q.shape[1], -1)[:, self.heads].reshape(x.shape[0], -1)

    def keys_and_values(self, swapped: bool) -> AttentionRows:
        """The candidate's rows, or (`swapped`) with its k and v in each other's place."""
        return replace(self.cand, k=self.cand.v, v=self.cand.k) if swapped else self.cand

    def scores(self, row: int, n_keys: int, kv_heads: tuple[int, ...] | None = None,
               swapped: bool = False) -> np.ndarray:
        key = (row, n_keys, kv_heads, swapped)
        if key not in self.raw:
            self.raw[key] = self.keys_and_values(swapped).raw_scores(row, n_keys, kv_heads).astype(np.float32)
        return self.raw[key].astype(np.float64)

    def n_keys(self, row: int, h: Hypothesis | None = None) -> int:
        """Key rows `h` reads at `row`: up to the next recorded one, or its own reach."""
        return min(row + 2, self.cand.k.shape[0]) if h is None or h.reach is None else h.reach(row)

    def predict(self, h: Hypothesis) -> np.ndarray:
        """The hypothesis's attention output before o_proj at every tested row (NaN where it reads
        keys the trace did not record)."""
        if h.moved is not None:
            return self._predict_moved(h)
        keys = [self.n_keys(r, h) for r in self.rows]
        if max(keys) > self.cand.k.shape[0] or (h.swapped and self.cand.k.shape != self.cand.v.shape):
            return self._untestable()
        rows, window = self.keys_and_values(h.swapped), None if h.own_window else self.window
        return np.stack([rows.attend(r, self.scores(r, n, h.kv_heads, h.swapped),
                                     h.visible(r, n) & in_window(r, n, window), h.scale,
                                     h.softcap, h.kv_heads, None if h.zeroed is None else h.zeroed(r, n), sinks=h.sinks)
                          for r, n in zip(self.rows, keys)])

    def _untestable(self) -> np.ndarray:
        """`predict`'s answer where a hypothesis reads what the trace did not record: NaN rows."""
        return np.full((self.rows.size, self.cand.q.shape[1] * self.cand.v.shape[2]), np.nan)

    def _predict_moved(self, h: Hypothesis) -> np.ndarray:
        """`predict` where each cache slot holds another row's K/V (`h.moved`), or a zero row."""
        out = []
        for r in self.rows:
            order = h.moved(int(r))
            n = int(order.max()) + 1
            if n > self.cand.k.shape[0]:
                return self._untestable()
            src = np.maximum(order, 0)
            raw = self.scores(int(r), max(n, 1))[:, src]
            out.append(self.cand.attend(int(r), raw, in_window(int(r), order.size, self.window), h.scale,
                                        zeroed=order < 0, values=src))
        return np.stack(out)

    def own_miss(self, h: Hypothesis) -> float:
        """With z recorded: the share of the candidate's own z at the tested rows that the hypothesis
        misses, against no reference row (rows past a token flip have none to compare)."""
        z = self.compared(self.predict(h))
        out = self.compared(self.cand.out[self.rows].astype(np.float64))
        power = float(np.linalg.norm(out))
        if not np.isfinite(z).all() or power == 0:
            return np.inf
        return float(np.linalg.norm(out - z)) / power

    def score(self, h: Hypothesis) -> Score:
        z = self.compared(self.predict(h))
        out = self.compared(self.cand.out[self.rows].astype(np.float64))
        change = np.linalg.norm(out - self.compared(self.ref.out[self.rows].astype(np.float64)), axis=1)
        if not np.isfinite(z).all():
            return Score(h, np.inf, np.inf)
        err = np.linalg.norm(self.fit.unexplained(z, out), axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return Score(h, float(np.sqrt((err ** 2).sum() / (change ** 2).sum())), float(np.median(err / change)))


def cap_rows(rows: np.ndarray, most: int = MAX_ROWS) -> np.ndarray:
    """At most `most` of `rows`: the first half of them, and the rest spread over the others."""
    if rows.size <= most:
        return rows
    rest = rows[np.linspace(most // 2, rows.size - 1, most - most // 2).astype(int)]
    return np.unique(np.concatenate([rows[:most // 2], rest]))


def causal(row: int, n: int) -> np.ndarray:
    return np.arange(n) <= row


def in_window(row: int, n: int, window: int | None) -> np.ndarray:
    """Keys 0..n-1 a sliding window of `window` leaves `row` (every key where None)."""
    return np.ones(n, bool) if window is None else np.arange(n) > row - window

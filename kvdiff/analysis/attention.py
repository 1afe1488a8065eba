"""The reference's attention, recomputed from its recorded q, k and v (GQA, causal)."""

from __future__ import annotations

import numpy as np


def _grouped(q_row: np.ndarray, rows: np.ndarray, n: int, weights: np.ndarray | None = None) -> np.ndarray:
    """Per head: q_row (heads, d) against rows[:n] (n, kv_heads, d) of its kv head, float64 (heads, n);
    or, given `weights` (heads, n), the weighted sum of rows[:n] (heads, d). One kv group at a time,
    so no copy of the rows repeated per head is made."""
    heads, kv = q_row.shape[0], rows.shape[1]
    per = heads // kv
    out = np.empty((heads, n) if weights is None else (heads, rows.shape[2]))
    for g in range(kv):
        block = rows[:n, g, :].astype(np.float64, copy=False)
        sel = slice(g * per, (g + 1) * per)
        out[sel] = q_row[sel].astype(np.float64) @ block.T if weights is None else weights[sel] @ block
    return out


def span_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray, query_rows: np.ndarray,
                   span: tuple[int, int], scale: float, window: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per query row, in one pass over its softmax: the share of its attention mass (mean over
    heads) on key positions within `span`, and how far its attention output (all heads, before
    o_proj) moves, relative to its norm, when those keys are left out (1 where it sees no other).

    q: (n, heads, d), k and v: (n, kv_heads, d) rows at increasing `positions`; `query_rows` index
    q; each query attends causally to keys at positions <= its own (and, with the layer's sliding
    `window`, past its own minus the window). Softmax in float64; NaN for a query row whose scores
    hold NaN or Inf.
    """
    inside = (positions >= span[0]) & (positions <= span[1])
    seen = np.searchsorted(positions, positions[query_rows], side="right")
    mass, shift = np.zeros(query_rows.size), np.ones(query_rows.size)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for i, (row, n) in enumerate(zip(query_rows, seen)):
            scores = _grouped(q[row], k, n) * scale
            if window is not None:
                scores[:, positions[:n] <= positions[row] - window] = -np.inf
            scores -= scores.max(axis=1, keepdims=True)
            weights = np.exp(scores)
            weights /= weights.sum(axis=1, keepdims=True)
            mass[i] = weights[:, inside[:n]].sum(axis=1).mean()
            kept = weights * ~inside[:n]
            if not kept.any():
                continue
            full = _grouped(q[row], v, n, weights)
            without = _grouped(q[row], v, n, kept / kept.sum(axis=1, keepdims=True))
            shift[i] = np.linalg.norm(without - full) / np.linalg.norm(full)
    return mass, shift


def differing_heads(ref: np.ndarray, cand: np.ndarray, rows: np.ndarray, heads: int, atol: float,
                    rtol: float) -> np.ndarray | None:
    """The query heads whose attention output (rows (n, heads * dv)) differs beyond tolerance at
    `rows`, where that is some heads but not all; else None (every head, or none, differs)."""
    r = ref[rows].reshape(rows.size, heads, -1).astype(np.float64)
    c = cand[rows].reshape(rows.size, heads, -1).astype(np.float64)
    with np.errstate(invalid="ignore"):
        bad = ~(np.abs(c - r) <= atol + rtol * np.abs(r)).all(axis=(0, 2))
    return np.flatnonzero(bad) if 0 < bad.sum() < heads else None

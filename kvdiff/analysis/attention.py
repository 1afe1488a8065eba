"""The reference's attention, recomputed from its recorded q, k and v (GQA, causal)."""

from __future__ import annotations

from typing import Iterator

import numpy as np


def _by_head(rows: np.ndarray, heads: int) -> np.ndarray:
    """(n, kv_heads, d) rows as float64 (heads, n, d), each kv head repeated for its query heads."""
    repeated = np.repeat(rows.astype(np.float64), heads // rows.shape[1], axis=1)
    return np.ascontiguousarray(repeated.transpose(1, 0, 2))


def _weights(q: np.ndarray, k: np.ndarray, positions: np.ndarray, query_rows: np.ndarray,
             scale: float) -> Iterator[tuple[int, np.ndarray]]:
    """Per query row: how many keys it sees (positions are increasing: those up to its own) and the
    softmax weights (heads, seen keys) over them, in float64."""
    kk = _by_head(k, q.shape[1])
    seen = np.searchsorted(positions, positions[query_rows], side="right")
    with np.errstate(invalid="ignore", over="ignore"):
        for row, n in zip(query_rows, seen):
            scores = np.matmul(kk[:, :n], q[row].astype(np.float64)[:, :, None])[..., 0] * scale
            scores -= scores.max(axis=1, keepdims=True)
            weights = np.exp(scores)
            yield n, weights / weights.sum(axis=1, keepdims=True)


def span_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray, query_rows: np.ndarray,
                   span: tuple[int, int], scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Per query row, in one pass over its softmax: the share of its attention mass (mean over
    heads) on key positions within `span`, and how far its attention output (all heads, before
    o_proj) moves, relative to its norm, when those keys are left out (1 where it sees no other).

    q: (n, heads, d), k and v: (n, kv_heads, d) rows at increasing `positions`; `query_rows` index
    q; each query attends causally to keys at positions <= its own. Softmax in float64; NaN for a
    query row whose scores hold NaN or Inf.
    """
    vv = _by_head(v, q.shape[1])
    inside = (positions >= span[0]) & (positions <= span[1])
    mass, shift = np.zeros(query_rows.size), np.ones(query_rows.size)
    with np.errstate(invalid="ignore", divide="ignore"):
        for i, (n, weights) in enumerate(_weights(q, k, positions, query_rows, scale)):
            mass[i] = weights[:, inside[:n]].sum(axis=1).mean()
            kept = weights * ~inside[:n]
            if not kept.any():
                continue
            full = np.matmul(weights[:, None, :], vv[:, :n])
            without = np.matmul((kept / kept.sum(axis=1, keepdims=True))[:, None, :], vv[:, :n])
            shift[i] = np.linalg.norm(without - full) / np.linalg.norm(full)
    return mass, shift

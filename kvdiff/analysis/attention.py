"""The reference's attention, recomputed from its recorded q, k and v (GQA, causal)."""

from __future__ import annotations

from typing import Iterator

import numpy as np


def _weights(q: np.ndarray, k: np.ndarray, positions: np.ndarray, query_rows: np.ndarray,
             scale: float) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Per query row: its keys' visibility (positions <= its own) and the softmax weights
    (heads, visible keys) over them, in float64."""
    group = q.shape[1] // k.shape[1]
    kk = np.repeat(k.astype(np.float64), group, axis=1)                   # (n, heads, d)
    with np.errstate(invalid="ignore", over="ignore"):
        for row in query_rows:
            visible = positions <= positions[row]
            scores = np.einsum("hd,shd->hs", q[row].astype(np.float64), kk[visible]) * scale
            scores -= scores.max(axis=1, keepdims=True)
            weights = np.exp(scores)
            yield visible, weights / weights.sum(axis=1, keepdims=True)


def attention_mass(q: np.ndarray, k: np.ndarray, positions: np.ndarray, query_rows: np.ndarray,
                   span: tuple[int, int], scale: float) -> np.ndarray:
    """Share of each query row's attention mass (mean over heads) on key positions within `span`.

    q: (n, heads, d) and k: (n, kv_heads, d) rows at `positions`; `query_rows` index q; each query
    attends causally to keys at positions <= its own. Softmax in float64; NaN for a query row whose
    scores hold NaN or Inf.
    """
    inside = (positions >= span[0]) & (positions <= span[1])
    return np.array([weights[:, inside[visible]].sum(axis=1).mean()
                     for visible, weights in _weights(q, k, positions, query_rows, scale)])


def attention_shift(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray, query_rows: np.ndarray,
                    span: tuple[int, int], scale: float) -> np.ndarray:
    """How far each query row's attention output (all heads, before o_proj) moves, relative to its
    norm, when the keys at positions within `span` are left out; the same arguments as
    `attention_mass` and v: (n, kv_heads, d). 1 where no key outside `span` is visible."""
    group = q.shape[1] // k.shape[1]
    vv = np.repeat(v.astype(np.float64), group, axis=1)                   # (n, heads, d)
    outside = (positions < span[0]) | (positions > span[1])
    out = np.ones(query_rows.size)
    with np.errstate(invalid="ignore", divide="ignore"):
        for i, (visible, weights) in enumerate(_weights(q, k, positions, query_rows, scale)):
            kept = weights * outside[visible]
            if not kept.any():
                continue
            full = np.einsum("hs,shd->hd", weights, vv[visible])
            without = np.einsum("hs,shd->hd", kept / kept.sum(axis=1, keepdims=True), vv[visible])
            out[i] = np.linalg.norm(without - full) / np.linalg.norm(full)
    return out

"""The reference's attention weights, recomputed from its recorded q and k (GQA, causal)."""

from __future__ import annotations

import numpy as np


def attention_mass(q: np.ndarray, k: np.ndarray, positions: np.ndarray, query_rows: np.ndarray,
                   span: tuple[int, int], scale: float) -> np.ndarray:
    """Share of each query row's attention mass (mean over heads) on key positions within `span`.

    q: (n, heads, d) and k: (n, kv_heads, d) rows at `positions`; `query_rows` index q; each query
    attends causally to keys at positions <= its own. Softmax in float64; NaN for a query row whose
    scores hold NaN or Inf.
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    group = heads // kv_heads
    kk = np.repeat(k.astype(np.float64), group, axis=1)                   # (n, heads, d)
    inside = (positions >= span[0]) & (positions <= span[1])
    out = np.zeros(query_rows.size)
    with np.errstate(invalid="ignore", over="ignore"):
        for i, row in enumerate(query_rows):
            visible = positions <= positions[row]
            scores = np.einsum("hd,shd->hs", q[row].astype(np.float64), kk[visible]) * scale
            scores -= scores.max(axis=1, keepdims=True)
            weights = np.exp(scores)
            weights /= weights.sum(axis=1, keepdims=True)
            out[i] = weights[:, inside[visible]].sum(axis=1).mean()
    return out

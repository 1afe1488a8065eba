"""RoPE geometry read back from recorded keys (rotate_half convention, as HF Llama).

For head_dim d, element pairs (i, i + d/2) form complex numbers z_i; RoPE at position p
multiplies z_i by exp(j * p * theta_i). The frequencies theta_i are measured from the
reference's own keys (the rotation between consecutive positions, refined by a least-squares fit
of the phase over every position), so no rope base or scaling
scheme has to be known. A key's encoded position is then the integer p that best explains the
rotation from k_pre_rope to k over every pair and head (a matched filter over all frequencies,
which is unambiguous far beyond any context length).
"""

from __future__ import annotations

import numpy as np


def _complex(x: np.ndarray) -> np.ndarray:
    """(..., d) real -> (..., d/2) complex pairs (i, i + d/2)."""
    half = x.shape[-1] // 2
    return x[..., :half].astype(np.float64) + 1j * x[..., half:].astype(np.float64)


def rotations(k_pre: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Per row and pair: sum over heads of k * conj(k_pre), (n, d/2) complex (magnitude = weight)."""
    return (_complex(k) * np.conj(_complex(k_pre))).sum(axis=1)


def estimate_thetas(k_pre: np.ndarray, k: np.ndarray, positions: np.ndarray) -> np.ndarray | None:
    """RoPE frequencies (d/2,) from rows at known `positions` (needs two consecutive positions)."""
    if positions.size < 2:
        return None
    r = rotations(k_pre, k)
    unit = r / np.maximum(np.abs(r), 1e-300)
    consecutive = np.flatnonzero(np.diff(positions) == 1)
    if consecutive.size == 0:
        return None
    step = (unit[consecutive + 1] * np.conj(unit[consecutive])).sum(axis=0)
    coarse = np.mod(np.angle(step), 2 * np.pi)
    # Refine with every position: the residual phase grows linearly with p (least squares).
    p = positions.astype(np.float64)[:, None]
    residual = np.angle(unit * np.exp(-1j * p * coarse[None, :]))
    return coarse + (p * residual).sum(axis=0) / max(float((p * p).sum()), 1.0)


def estimate_positions(k_pre: np.ndarray, k: np.ndarray, thetas: np.ndarray, max_position: int,
                       min_position: int = 0, batch: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """The rotation (in positions) from `k_pre` to `k` per row, in [min_position, max_position],
    and the fit quality in [0, 1].

    Quality is the matched-filter score over the sum of weights: 1 for an exact rotation.
    """
    r = rotations(k_pre, k)
    candidates = np.arange(min_position, max_position + 1, dtype=np.float64)
    phase = np.exp(-1j * candidates[:, None] * thetas[None, :])           # (C, d/2)
    best = np.zeros(r.shape[0], dtype=np.int64)
    quality = np.zeros(r.shape[0])
    for lo in range(0, r.shape[0], batch):
        chunk = r[lo:lo + batch]
        scores = (chunk @ phase.T).real                                   # (b, C)
        best[lo:lo + batch] = scores.argmax(axis=1) + min_position
        weight = np.abs(chunk).sum(axis=1)
        quality[lo:lo + batch] = scores.max(axis=1) / np.maximum(weight, 1e-300)
    return best, quality


def rotate(x: np.ndarray, delta: np.ndarray, thetas: np.ndarray) -> np.ndarray:
    """Rows (n, heads, d) rotated by a further `delta` (n,) positions; float32 result."""
    z = _complex(x) * np.exp(1j * delta[:, None, None] * thetas[None, None, :])
    return np.concatenate([z.real, z.imag], axis=-1).astype(np.float32)

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
    z = np.empty((*x.shape[:-1], half), dtype=np.complex128)
    z.real, z.imag = x[..., :half], x[..., half:]
    return z


def _finite_rows(*arrays: np.ndarray) -> np.ndarray:
    """Bool per row (first axis): every element of every array is finite."""
    # all() over the row's axes, not a reshape(n, -1): that cannot take zero rows
    return np.logical_and.reduce([np.isfinite(a).all(axis=tuple(range(1, a.ndim))) for a in arrays])


def _unit_scale(x: np.ndarray) -> np.ndarray:
    """Finite rows (n, heads, d) divided by their largest |element|: same angles, no overflow."""
    x = x.astype(np.float64)
    return x / np.maximum(np.abs(x).max(axis=(1, 2), keepdims=True, initial=0.0), 1e-300)


def rotations(k_pre: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Per finite row and pair: sum over heads of k * conj(k_pre), (n, d/2) complex (magnitude =
    weight, relative within a row: rows are scaled to a largest element of 1)."""
    return (_complex(_unit_scale(k)) * np.conj(_complex(_unit_scale(k_pre)))).sum(axis=1)


def estimate_thetas(k_pre: np.ndarray, k: np.ndarray, positions: np.ndarray) -> np.ndarray | None:
    """RoPE frequencies (d/2,) from rows at known `positions` (needs two consecutive positions with
    finite keys)."""
    finite = _finite_rows(k_pre, k)
    k_pre, k, positions = k_pre[finite], k[finite], positions[finite]
    if positions.size < 2:
        return None
    r = rotations(k_pre, k)
    unit = r / np.maximum(np.abs(r), 1e-300)
    consecutive = np.flatnonzero(np.diff(positions) == 1)
    if consecutive.size == 0:
        return None
    step = (unit[consecutive + 1] * np.conj(unit[consecutive])).sum(axis=0)
    coarse = np.mod(np.angle(step), 2 * np.pi)
    # Refine: the residual phase grows linearly with p. Most rows' slope (a median) first, then least
    # squares over the rows that fit it (rows rotated to other positions, such as a run's decode steps
    # encoded one position on, would bend the line).
    p = positions.astype(np.float64)[:, None]
    residual = np.angle(unit * np.exp(-1j * p * coarse[None, :]))
    ahead = p[:, 0] > 0
    if ahead.sum() < 2:
        return coarse + (p * residual).sum(axis=0) / max(float((p * p).sum()), 1.0)
    robust = coarse + np.median(residual[ahead] / p[ahead], axis=0)      # most rows' slope, whatever the others'
    misfit = np.abs(np.angle(unit * np.exp(-1j * p * robust[None, :]))).mean(axis=1)
    kept = misfit <= 3 * float(np.median(misfit)) + 1e-9
    p, residual = p[kept], residual[kept]
    return coarse + (p * residual).sum(axis=0) / max(float((p * p).sum()), 1.0)


def estimate_positions(k_pre: np.ndarray, k: np.ndarray, thetas: np.ndarray, max_position: int,
                       min_position: int = 0, batch: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """The rotation (in positions) from `k_pre` to `k` per row, in [min_position, max_position],
    and the fit quality in [0, 1].

    Quality is the matched-filter score over the sum of weights: 1 for an exact rotation, 0 for a row
    holding NaN or Inf (its position is reported as `min_position`).
    """
    finite = np.flatnonzero(_finite_rows(k_pre, k))
    r = rotations(k_pre[finite], k[finite])
    candidates = np.arange(min_position, max_position + 1, dtype=np.float64)
    phase = np.exp(-1j * candidates[:, None] * thetas[None, :])           # (C, d/2)
    best = np.full(k.shape[0], min_position, dtype=np.int64)
    quality = np.zeros(k.shape[0])
    for lo in range(0, r.shape[0], batch):
        chunk, rows = r[lo:lo + batch], finite[lo:lo + batch]
        scores = (chunk @ phase.T).real                                   # (b, C)
        best[rows] = scores.argmax(axis=1) + min_position
        weight = np.abs(chunk).sum(axis=1)
        quality[rows] = scores.max(axis=1) / np.maximum(weight, 1e-300)
    return best, quality


def rotate(x: np.ndarray, delta: np.ndarray, thetas: np.ndarray) -> np.ndarray:
    """Rows (n, heads, d) rotated by a further `delta` (n,) positions; float32 result."""
    with np.errstate(invalid="ignore", over="ignore"):     # rows holding NaN or Inf stay non-finite
        z = _complex(x) * np.exp(1j * delta[:, None, None] * thetas[None, None, :])
    return np.concatenate([z.real, z.imag], axis=-1).astype(np.float32)


def frame_shift(thetas: np.ndarray, horizon: int, rows: dict, cols: np.ndarray) -> np.ndarray | None:
    """Per column, the rotation (in positions) taking the candidate's q into its own k's frame, where
    both are exact rotations of the reference's and the offsets differ at some column; else None.
    `rows`: point -> (reference's, candidate's) rows of the columns RoPE rotates."""
    found = []
    for point in ("q", "k"):
        ref, cand = rows[point]
        shift, quality = estimate_positions(ref[cols], cand[cols], thetas, horizon, -horizon, batch=8)
        found.append((shift, quality >= 1 - 1e-4))
    (dq, okq), (dk, okk) = found
    delta = np.where(okq & okk, dk - dq, 0)
    return delta if delta.any() else None

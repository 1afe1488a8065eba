"""The first layer's keys read back: is the candidate's k the reference's key content rotated by
RoPE, and to which positions?

RoPE multiplies each rotate_half pair of k_pre_rope by a unit complex number: the pairs' magnitudes
stay, only their angles move. So where k differs, the magnitudes tell a rotation (all equal within
tolerance), a scaled rotation (all times one factor: RoPE's cos/sin scaled, or the keys themselves)
and other content (anything else: not RoPE's doing). For a rotation, the angles are matched
against every integer position with the reference's own frequencies: `exact` where one position
fits as well as rounding allows. The content rotated is, at positions the candidate computed, its
own k_pre_rope (so the rotation is judged whatever came before it: another projection, an
engine's quantized matmuls), and at positions it read from a cache (no k_pre_rope recorded there)
the reference's: nothing is assumed, the magnitudes decide.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvdiff.analysis.rope import _complex, _finite_rows, estimate_positions, estimate_thetas

ROTATION, SCALED, CONTENT = "rotation", "scaled", "content"
# 1 - fit quality that rounding of the traces' dtype allows for an exact rotation.
_QUALITY_SLACK = {"float32": 1e-6, "float16": 1e-4, "bfloat16": 2e-3}


@dataclass(frozen=True)
class KeyRows:
    """Aligned columns whose first-layer k differs while its content before RoPE is known or tested."""

    cols: np.ndarray
    cached: np.ndarray          # bool: read from a cache (no k_pre_rope recorded there)
    kind: np.ndarray            # ROTATION, SCALED or CONTENT per column
    factor: np.ndarray          # the common magnitude factor (1 for a rotation)
    magnitude_rel: np.ndarray   # largest magnitude residual after the factor, relative to the row's largest
    encoded: np.ndarray         # best integer position with the reference's frequencies
    quality: np.ndarray         # its fit quality (1: an exact rotation)
    threshold: float            # quality from which a rotation fits an integer position exactly

    @property
    def exact(self) -> np.ndarray:
        return self.quality >= self.threshold

    def where(self, mask: np.ndarray) -> "KeyRows":
        return KeyRows(self.cols[mask], self.cached[mask], self.kind[mask], self.factor[mask], self.magnitude_rel[mask],
                       self.encoded[mask], self.quality[mask], self.threshold)


def pair_magnitudes(x: np.ndarray) -> np.ndarray:
    """(n, heads, d) -> (n, heads * d/2) magnitudes of the rotate_half pairs, float64."""
    z = _complex(x.astype(np.float64))
    return np.abs(z).reshape(z.shape[0], int(np.prod(z.shape[1:])))


def classify(k_pre: np.ndarray, k: np.ndarray, atol: float, rtol: float,
             scale: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: kind, common magnitude factor, and the magnitude residual relative to the row's largest;
    `scale`: the factor RoPE itself applies (rope_scale), which a rotation keeps."""
    m_ref, m_cand = pair_magnitudes(k_pre) * scale, pair_magnitudes(k)
    with np.errstate(invalid="ignore", divide="ignore"):
        factor = (m_ref * m_cand).sum(1) / (m_ref * m_ref).sum(1)
        top = np.abs(m_ref).max(axis=1)
        bound = atol + rtol * top
        residual = np.abs(m_cand - factor[:, None] * m_ref).max(axis=1)
        same_shape = residual <= bound
        unscaled = np.abs(factor - 1) * top <= bound
        # a zero row keeps no content to scale (a slot never written): content, not a factor of 0
        scaled = same_shape & np.isfinite(factor) & (np.abs(m_cand).max(axis=1) > 0)
        kind = np.where(same_shape & unscaled, ROTATION, np.where(scaled, SCALED, CONTENT))
        return kind, np.where(np.isfinite(factor), factor, np.nan), residual / np.maximum(top, 1e-300)


def rope_scale(k_pre: np.ndarray, k: np.ndarray) -> float:
    """The factor RoPE multiplies every pair's magnitude by, measured on the reference's own keys:
    1 for plain RoPE, YaRN's attention scaling where cos and sin carry it (gpt-oss)."""
    finite = _finite_rows(k_pre, k)
    if not finite.any():
        return 1.0
    _, factor, _ = classify(k_pre[finite], k[finite], 0.0, 0.0)
    factor = factor[np.isfinite(factor)]
    return float(np.median(factor)) if factor.size else 1.0


def interleaved(x: np.ndarray) -> np.ndarray:
    """(..., d) with the interleaved pairs (2i, 2i+1) moved to (i, i + d/2): the rotate_half analysis
    of the result is the analysis of RoPE in the interleaved (GPT-J) convention."""
    return np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def key_rows(k_pre_ref: np.ndarray, k_cand: np.ndarray, cols: np.ndarray, cached: np.ndarray, thetas: np.ndarray | None,
             horizon: int, atol: float, rtol: float, dtypes: tuple[str, ...], scale: float = 1.0) -> KeyRows:
    kind, factor, rel = classify(k_pre_ref[cols], k_cand[cols], atol, rtol, scale)
    if thetas is not None and cols.size:
        # negative positions too: a rotation the other way (the sin's sign flipped) encodes -p
        encoded, quality = estimate_positions(k_pre_ref[cols], k_cand[cols], thetas, horizon, -horizon)
    else:
        encoded, quality = np.full(cols.size, -1, dtype=np.int64), np.zeros(cols.size)
    slack = max(_QUALITY_SLACK.get(d, 2e-3) for d in dtypes)
    return KeyRows(cols, cached, kind, factor, rel, encoded, quality, 1.0 - slack)


@dataclass(frozen=True)
class Frequencies:
    """The candidate's RoPE frequencies measured on its keys at the expected positions, against the reference's."""

    candidate: np.ndarray
    reference: np.ndarray
    scaling: float | None        # positions scaled by this factor (all frequencies divided by it), if that fits
    candidate_base: float | None  # theta_i = base^(-2i/d) (divided by `scaling` where both are set), if that fits
    reference_base: float | None
    quality: float                # how well the candidate's frequencies explain its rotations (1: exactly)


def _base(thetas: np.ndarray, scaled: bool = False) -> tuple[float | None, float, float]:
    """The base b (and, where `scaled`, the factor s) with theta_i = b^(-2i/d) / s, and the largest
    relative deviation of the thetas from it (s is 1 unless `scaled`)."""
    i = np.arange(thetas.size, dtype=np.float64)
    if thetas.size < 2 or (thetas <= 0).any():
        return None, 1.0, np.inf
    x, y = 2 * i / (2 * thetas.size), -np.log(thetas)
    if scaled:
        slope, log_s = (float(v) for v in np.polyfit(x, y, 1))
    else:
        slope, log_s = float((x * y).sum() / max(float((x * x).sum()), 1e-300)), 0.0
    fitted = np.exp(-slope * x - log_s)
    return float(np.exp(slope)), float(np.exp(log_s)), float(np.abs(fitted / thetas - 1).max())


def measure_frequencies(k_pre: np.ndarray, k: np.ndarray, positions: np.ndarray,
                        reference: np.ndarray) -> Frequencies | None:
    """Fit the candidate's frequencies from its rotations at `positions` (assumed encoded there)."""
    thetas = estimate_thetas(k_pre, k, positions)
    if thetas is None:
        return None
    _, quality = estimate_positions(k_pre, k, thetas, int(positions.max()) + 1, int(positions.min()))
    ratio = thetas / reference
    scaling = float(1 / np.median(ratio)) if np.abs(ratio / np.median(ratio) - 1).max() <= 0.01 else None
    cand_base, _, cand_dev = _base(thetas)
    ref_base, _, ref_dev = _base(reference)
    fits = cand_dev <= 0.01 and ref_dev <= 0.01
    if scaling is None and not fits and ref_dev <= 0.01:      # another base and positions scaled, both at once
        base, factor, dev = _base(thetas, scaled=True)
        if dev <= 0.01:
            cand_base, scaling, fits = base, factor, True
    return Frequencies(thetas, reference, scaling if scaling is None or abs(scaling - 1) > 1e-3 else None,
                       cand_base if fits else None, ref_base if fits else None, float(quality.min()))

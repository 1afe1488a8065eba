"""What a norm ran with, where it is not the norm its trace declares: fitted from its recorded rows.

A candidate's norm output that is not w * x / sqrt(mean(x^2) + eps) of its own recorded input, with
the weight and eps its trace declares, is tried against the forms engines get wrong: another
epsilon (solved from the rows), Gemma's (1 + w) scale, no weight, the norm skipped (its output is
its input) and the output times one factor. A form is named only where it reproduces every tested
row within the recomputation tolerance; else, in a float32 trace, a norm computed in bfloat16 or
float16 (every output element a value of that format, within a few of its roundoffs). Where the
two traces declare different norms, what differs (eps, the weight by one offset or factor, or
elsewhere) is said from the declared values.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvdiff.analysis.align import Alignment
from kvdiff.analysis.metrics import row_metrics
from kvdiff.analysis.norms import NORM_IO, RECOMPUTE_FLOAT32, NormCheck, recompute_rms_norm
from kvdiff.analysis.storage import UNIT_ROUNDOFF, round_to
from kvdiff.analysis.tolerance import Tolerance, Tolerances
from kvdiff.errors import TraceError
from kvdiff.trace import TraceReader

ROWS = 64       # rows a fit is tested on (the first ones that break the declared norm)


@dataclass(frozen=True)
class NormFit:
    """A form that reproduces the candidate's norm: `form` ("eps", "one plus weight", "no weight",
    "skipped", "scaled", "precision"), in words, its value (the epsilon or the factor), and the worst
    rel left."""

    form: str
    text: str
    value: float | None
    rel: float


def _fits(out: np.ndarray, predicted: np.ndarray, tolerance: Tolerance) -> tuple[bool, float]:
    metrics = row_metrics(out, predicted)
    return bool(metrics.within(tolerance).all()), float(np.nanmax(metrics.rel))


def _solved_eps(x: np.ndarray, out: np.ndarray, weight: np.ndarray) -> float | None:
    """The epsilon each row's scale 1/sqrt(mean(x^2) + eps) implies, median over rows (None: none)."""
    wx = x.astype(np.float64) * weight.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        big = np.abs(wx) >= 0.5 * np.abs(wx).max(axis=1, keepdims=True)
        ratio = np.where(big, out.astype(np.float64) / wx, np.nan)
        scale = np.nanmedian(ratio, axis=1)
        eps = 1.0 / scale ** 2 - (x.astype(np.float64) ** 2).mean(axis=1)
    eps = eps[np.isfinite(eps)]
    return float(np.median(eps)) if eps.size and np.median(eps) > 0 else None


def fit_norm(x: np.ndarray, out: np.ndarray, weight: np.ndarray, eps: float, dtype: str,
             tolerance: Tolerance) -> NormFit | None:
    """The first form that reproduces `out` from `x` (rows of one norm), or None."""
    x, out = x[:ROWS], out[:ROWS]
    declared = recompute_rms_norm(x, weight, eps, dtype)
    tried: list[tuple[str, str, float | None, np.ndarray]] = []
    solved = _solved_eps(x, out, weight)
    if solved is not None:
        tried.append(("eps", f"RMSNorm with eps {solved:.3g} (its trace declares {eps:.3g})", solved,
                      recompute_rms_norm(x, weight, solved, dtype)))
    tried += [("one plus weight", "RMSNorm scaled by (1 + weight), Gemma's form, where the model scales by weight",
               None, recompute_rms_norm(x, 1.0 + weight.astype(np.float32), eps, dtype)),
              ("no weight", "RMSNorm without its weight", None, recompute_rms_norm(x, np.ones_like(weight), eps, dtype)),
              ("skipped", "the norm skipped: its output is its input", None, x)]
    with np.errstate(invalid="ignore", divide="ignore"):
        factor = float((out.astype(np.float64) * declared).sum() / (declared.astype(np.float64) ** 2).sum())
    if np.isfinite(factor) and abs(factor - 1) > 1e-3:
        tried.append(("scaled", f"the declared RMSNorm's output times {factor:.4g}", factor, declared * factor))
    for form, text, value, predicted in tried:
        ok, rel = _fits(out, predicted, tolerance)
        if ok:
            return NormFit(form, text, value, rel)
    return _narrower(out, declared) if dtype == "float32" else None


def _narrower(out: np.ndarray, declared: np.ndarray) -> NormFit | None:
    """The declared norm computed in a narrower format, where every output element is a value of it
    and every row within a few of its unit roundoffs of the float32 norm; else None."""
    for name, roundoff in reversed(UNIT_ROUNDOFF):     # the coarser grid first: its values lie on the finer one
        if not np.array_equal(round_to(out, name), out.astype(np.float32)):
            continue
        rel = float(np.nanmax(np.abs(out - declared)) / max(float(np.nanmax(np.abs(declared))), 1e-30))
        if rel <= 8 * roundoff:
            return NormFit("precision", f"the declared RMSNorm computed in {name}: every output element is a {name} "
                           f"value, within {name}'s rounding of the float32 norm (max rel {rel:.3g})", None, rel)
    return None


def declared_difference(ref: tuple[np.ndarray, float], cand: tuple[np.ndarray, float]) -> str:
    """How the candidate's declared norm (weight, eps) differs from the reference's, in words."""
    (rw, reps), (cw, ceps) = ref, cand
    parts = [] if reps == ceps else [f"eps {reps:.3g} -> {ceps:.3g}"]
    rw, cw = np.asarray(rw, dtype=np.float64), np.asarray(cw, dtype=np.float64)
    if rw.shape != cw.shape:
        return "; ".join(parts + [f"weight of {cw.size} elements where the reference's has {rw.size}"])
    diff = cw - rw
    if not diff.any():
        return "; ".join(parts)
    offset = float(np.median(diff))
    with np.errstate(invalid="ignore", divide="ignore"):
        factor = float(np.median(cw[rw != 0] / rw[rw != 0])) if (rw != 0).any() else np.nan
    if np.allclose(diff, offset, rtol=0, atol=1e-3 * max(abs(offset), 1e-6)):
        parts.append(f"weight + {offset:.4g} at every element")
    elif np.isfinite(factor) and np.allclose(cw, rw * factor, rtol=1e-3, atol=0):
        parts.append(f"weight x {factor:.4g} at every element")
    else:
        parts.append(f"weight differs at {int((diff != 0).sum())} of {diff.size} elements (max abs "
                     f"{float(np.abs(diff).max()):.3g})")
    return "; ".join(parts)


def candidate_form(cand: TraceReader, alignment: Alignment, check: NormCheck, where: np.ndarray,
                   tolerances: Tolerances) -> NormFit | None:
    """`fit_norm` on the candidate's rows of `check`'s norm at the aligned columns `where` (its
    recorded input and output there, its declared weight and eps); None where none fits or the trace
    holds no weight."""
    try:
        weight, eps = cand.norm_weight(check.layer, check.norm)
    except TraceError:
        return None
    last = cand.meta.dims.num_layers - 1
    (src_layer, src), (dst_layer, dst) = ((last, "resid_post"), (None, "final_norm")) if check.layer is None else \
        ((check.layer, NORM_IO[check.norm][0]), (check.layer, NORM_IO[check.norm][1]))
    rows = alignment.cand_index[where[:ROWS]]
    dtype = cand.meta.dtype
    tolerance = RECOMPUTE_FLOAT32 if dtype == "float32" else tolerances.for_point(check.norm)
    return fit_norm(cand.point(src_layer, src, rows), cand.point(dst_layer, dst, rows), weight, eps, dtype, tolerance)

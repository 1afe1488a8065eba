"""Norm checks: recompute each RMSNorm from its recorded input and weights, and compare statistics.

RMSNorm works per token (no running statistics), so its output at a position depends only on
that position's input, its weight and eps. A recomputation that matches the recorded output
proves the norm ran as declared; statistics that differ between traces then come from inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvdiff.analysis.align import Alignment
from kvdiff.analysis.metrics import row_metrics
from kvdiff.analysis.tolerance import Tolerance, Tolerances
from kvdiff.errors import TraceError
from kvdiff.trace import TraceReader
from kvdiff.trace.norm_stats import norm_statistics
from kvdiff.trace.points import NORM_STATS

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A float32 norm recomputed from its own recorded input differs from the recorded output by a few
# ulps of the row at most (another summation order, rsqrt against 1/sqrt): ~70 ulps of the row's
# scale is a bound no clean engine measured reaches (the reference path, vLLM's CPU kernel and
# transformers' engine recompute bitwise), while another eps or weight moves every row by far more
# than that long before the output leaves the two traces' tolerance (1e-4 of the row in float32).
RECOMPUTE_FLOAT32 = Tolerance(atol=1e-6, rtol=8e-6)
# Each layer norm's input point and output point; the final norm reads the last resid_post.
NORM_IO = {"attn_norm": ("resid_pre", "attn_norm"), "mlp_norm": ("resid_mid", "mlp_norm"),
           "attn_post_norm": ("attn_out", "attn_post_norm"), "mlp_post_norm": ("mlp_out", "mlp_post_norm")}


@dataclass
class NormCheck:
    """One norm module (layer None: the final norm) over the aligned positions."""

    layer: int | None
    norm: str
    ref_recompute_rel: np.ndarray | None    # float64 (P,): rel of recorded vs recomputed output; None: no weight
    cand_recompute_rel: np.ndarray | None
    ref_consistent: np.ndarray | None       # bool (P,): recomputation within tolerance
    cand_consistent: np.ndarray | None
    input_tier: np.ndarray                  # int8 (P,): reference vs candidate norm input
    output_tier: np.ndarray                 # int8 (P,): reference vs candidate norm output
    stats_differ: np.ndarray | None         # bool (P,): a recorded statistic differs beyond tolerance
    differing_stats: list[str]              # names of the statistics that differ somewhere
    same_norm: bool | None                  # both traces declare the same weight and eps (None: unknown)
    # bool (P,): each trace's recorded statistics are those of its own recorded rows (input_rms,
    # max_abs, output_rms; None where a trace holds no statistics)
    ref_stats_of_rows: np.ndarray | None = None
    cand_stats_of_rows: np.ndarray | None = None


def recompute_rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, dtype: str) -> np.ndarray:
    """Llama RMSNorm from recorded rows: w * x / sqrt(mean(x^2) + eps) in fp32, cast to `dtype`."""
    xf = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    w = torch.from_numpy(np.asarray(weight, dtype=np.float32))
    out = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))
    return out.to(_TORCH_DTYPES.get(dtype, torch.float32)).float().numpy()


def _weight(trace: TraceReader, layer: int | None, norm: str) -> tuple[np.ndarray, float, str] | None:
    """The norm's weight, epsilon and the trace's dtype; None when the trace holds no weight."""
    try:
        weight, eps = trace.norm_weight(layer, norm)
    except TraceError:
        return None
    return weight, eps, trace.meta.dtype


def same_norm(ref: tuple[np.ndarray, float, str] | None, cand: tuple[np.ndarray, float, str] | None) -> bool | None:
    """Whether two traces declare the same norm: equal eps, and weights equal once the float32 one
    is rounded to the other's dtype. None when a trace holds no weight or the dtypes are two
    different half precisions."""
    if ref is None or cand is None:
        return None
    dtypes = {ref[2], cand[2]} - {"float32"}
    if len(dtypes) > 1 or not dtypes <= set(_TORCH_DTYPES):
        return None
    low = _TORCH_DTYPES[dtypes.pop()] if dtypes else torch.float32
    weights = [torch.from_numpy(np.asarray(w, dtype=np.float32)).to(low) for w, _, _ in (ref, cand)]
    return ref[1] == cand[1] and weights[0].shape == weights[1].shape and torch.equal(*weights)


def _stats_differ(ref: dict | None, cand: dict | None, alignment: Alignment,
                  tolerances: Tolerances, norm: str) -> tuple[np.ndarray | None, list[str]]:
    if not ref or not cand:
        return None, []
    tol = tolerances.for_point(norm)
    differ = np.zeros(alignment.positions.size, dtype=bool)
    names = []
    for stat in sorted(set(ref) & set(cand)):
        a = np.asarray(ref[stat][alignment.ref_index], dtype=np.float64)
        b = np.asarray(cand[stat][alignment.cand_index], dtype=np.float64)
        with np.errstate(invalid="ignore", over="ignore"):      # the same bits (NaN, Inf included) do not differ
            bad = ~((a.view(np.int64) == b.view(np.int64)) | (np.abs(a - b) <= tol.bound(np.abs(a))))
        if bad.any():
            names.append(stat)
            differ |= bad
    return differ, names


class NormChecker:
    """Checks one norm over blocks of aligned rows: both traces' self-consistency (recomputed from
    the recorded input and weights) and input/output agreement; `finish` adds the statistics."""

    def __init__(self, ref: TraceReader, cand: TraceReader, layer: int | None, norm: str, tolerances: Tolerances):
        self.layer, self.norm, self.tolerances = layer, norm, tolerances
        self._weights = (_weight(ref, layer, norm), _weight(cand, layer, norm))
        self._input_point = NORM_IO.get(norm, ("resid_post",))[0]
        self._blocks: list[tuple[np.ndarray | None, ...]] = []

    def _recompute(self, weight: tuple[np.ndarray, float, str] | None,
                   io: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray | None, np.ndarray | None]:
        if weight is None:
            return None, None
        metrics = row_metrics(io[1], recompute_rms_norm(io[0], *weight))
        tolerance = RECOMPUTE_FLOAT32 if weight[2] == "float32" else self.tolerances.for_point(self.norm)
        return metrics.rel, metrics.within(tolerance)

    def add(self, ref_io: tuple[np.ndarray, np.ndarray], cand_io: tuple[np.ndarray, np.ndarray]) -> None:
        """The next block of aligned rows: (norm input, norm output) of the reference and the candidate."""
        ref_rel, ref_ok = self._recompute(self._weights[0], ref_io)
        cand_rel, cand_ok = self._recompute(self._weights[1], cand_io)
        input_tier = row_metrics(ref_io[0], cand_io[0]).tiers(self.tolerances.for_point(self._input_point))
        output_tier = row_metrics(ref_io[1], cand_io[1]).tiers(self.tolerances.for_point(self.norm))
        self._blocks.append((ref_rel, cand_rel, ref_ok, cand_ok, input_tier, output_tier, _row_stats(ref_io),
                             _row_stats(cand_io)))

    def finish(self, ref_stats: dict | None, cand_stats: dict | None, alignment: Alignment) -> NormCheck:
        """The NormCheck over every block added, in order, with the recorded statistics compared."""
        joined = [None if parts[0] is None else np.concatenate(parts) for parts in zip(*self._blocks)]
        differ, names = _stats_differ(ref_stats, cand_stats, alignment, self.tolerances, self.norm)
        of_rows = (_stats_of_rows(stats, rows, index) for stats, rows, index in
                   ((ref_stats, joined[6], alignment.ref_index), (cand_stats, joined[7], alignment.cand_index)))
        return NormCheck(self.layer, self.norm, *joined[:6], differ, names, same_norm(*self._weights), *of_rows)


ROW_STATS = ("input_rms", "max_abs", "output_rms")      # the statistics checked against the rows recorded
STATS_OF_ROWS = 1e-5                                    # relative: float32 rows hold a statistic to ~1e-7 of itself


def _row_stats(io: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """ROW_STATS of a block's recorded (input, output) rows, as the recorder computes them: (rows, 3)."""
    if not len(io[0]):
        return np.zeros((0, len(ROW_STATS)))
    stats = norm_statistics(*(torch.from_numpy(np.ascontiguousarray(rows)) for rows in io)).numpy()
    return stats[[NORM_STATS.index(name) for name in ROW_STATS]].T


def _stats_of_rows(stats: dict | None, rows: np.ndarray, index: np.ndarray) -> np.ndarray | None:
    """Per aligned position, whether a trace's recorded statistics are those of its recorded rows."""
    if not stats or any(name not in stats for name in ROW_STATS):
        return None
    recorded = np.stack([np.asarray(stats[name][index], dtype=np.float64) for name in ROW_STATS], axis=1)
    with np.errstate(invalid="ignore"):
        close = np.abs(recorded - rows) <= STATS_OF_ROWS * np.maximum(np.abs(rows), 1e-30)
    return (close | (np.isnan(recorded) & np.isnan(rows))).all(axis=1)

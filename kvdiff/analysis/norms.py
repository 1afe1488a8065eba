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
from kvdiff.analysis.tolerance import Tier, Tolerances
from kvdiff.errors import TraceError
from kvdiff.probes.trace import TraceReader

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def recompute_rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, dtype: str) -> np.ndarray:
    """Llama RMSNorm from recorded rows: w * x / sqrt(mean(x^2) + eps) in fp32, cast to `dtype`."""
    xf = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    w = torch.from_numpy(np.asarray(weight, dtype=np.float32))
    out = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))
    return out.to(_TORCH_DTYPES.get(dtype, torch.float32)).float().numpy()


def _recompute(trace: TraceReader, layer: int | None, norm: str, io: tuple[np.ndarray, np.ndarray],
               tolerances: Tolerances) -> tuple[np.ndarray | None, np.ndarray | None]:
    try:
        weight, eps = trace.norm_weight(layer, norm)
    except TraceError:
        return None, None
    recomputed = recompute_rms_norm(io[0], weight, eps, trace.meta.dtype)
    metrics = row_metrics(io[1], recomputed)
    return metrics.rel, metrics.tiers(tolerances.for_point(norm)) <= Tier.NOISE


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


def check_norm(ref: TraceReader, cand: TraceReader, layer: int | None, norm: str,
               ref_io: tuple[np.ndarray, np.ndarray], cand_io: tuple[np.ndarray, np.ndarray],
               ref_stats: dict | None, cand_stats: dict | None, alignment: Alignment,
               tolerances: Tolerances) -> NormCheck:
    """Check one norm: both traces' self-consistency, and input/output/statistics agreement."""
    ref_rel, ref_ok = _recompute(ref, layer, norm, ref_io, tolerances)
    cand_rel, cand_ok = _recompute(cand, layer, norm, cand_io, tolerances)
    input_point = "resid_pre" if norm == "attn_norm" else "resid_mid" if norm == "mlp_norm" else "resid_post"
    input_tier = row_metrics(ref_io[0], cand_io[0]).tiers(tolerances.for_point(input_point))
    output_tier = row_metrics(ref_io[1], cand_io[1]).tiers(tolerances.for_point(norm))
    differ, names = _stats_differ(ref_stats, cand_stats, alignment, tolerances, norm)
    return NormCheck(layer, norm, ref_rel, cand_rel, ref_ok, cand_ok, input_tier, output_tier, differ, names)

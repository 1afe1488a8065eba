"""How an operation's broken output rows relate to the reference's: one factor, one added vector, a
factor per row, rows of other positions, another point's rows of the same trace, another storage.
Each account holds for every row tested (up to FACTOR_ROWS), leaving at most FACTOR_LEFT of the
change, or exactly."""

from __future__ import annotations

import numpy as np

from kvdiff.analysis.diagnose_cache import sources
from kvdiff.analysis.diagnosis import DiagnosisInputs
from kvdiff.analysis.storage import EXACT, Storage, same_rows, stored_as

FACTOR_ROWS = 64     # rows an output factor is fitted on
FACTOR_LEFT = 0.01   # the share of the change a factor may leave unexplained


def recorded_as(inputs: DiagnosisInputs, op, cols: np.ndarray) -> str | None:
    """Another point of the same layer, not one of `op`'s inputs (an output that is its input is
    diagnose_operation's `_passed_input`), whose candidate rows at `cols` (up to FACTOR_ROWS) are
    op's output rows exactly, where the reference's two differ: one tensor recorded under two names."""
    layer, tensor, skip = op.layer, op.tensor, {op.tensor} | {c.point for c in op.inputs}
    if layer is None:
        return None
    al, cols = inputs.comparison.alignment, cols[:FACTOR_ROWS]
    cand = inputs.candidate.point(layer, tensor, al.cand_index[cols])
    ref = inputs.reference.point(layer, tensor, al.ref_index[cols])
    if not cand.any():          # zero rows equal any other zero rows: RoPE of a zeroed key is its input
        return None
    for other, pmap in inputs.comparison.points.items():
        if other in skip or layer not in pmap.layers:
            continue
        rows = inputs.candidate.point(layer, other, al.cand_index[cols])
        if rows.shape == cand.shape and same_rows(rows, cand).all():
            ref_other = inputs.reference.point(layer, other, al.ref_index[cols])
            if ref_other.shape == ref.shape and not same_rows(ref_other, ref).all():
                return other
    return None


def moved_rows(inputs: DiagnosisInputs, layer: int | None, tensor: str, cols: np.ndarray) -> dict | None:
    """Where most of the candidate's broken rows at `cols` (two or more, up to FACTOR_ROWS) are, exactly,
    the reference's rows of `tensor` at other positions: {"sources" (per row, or None), "count",
    "text", "shift" (" by N" where one offset holds for them all, else "")}; else None."""
    al, cols = inputs.comparison.alignment, cols[:FACTOR_ROWS]
    if layer is None or cols.size < 2:
        return None
    ref, cand = inputs.rows(layer, tensor)
    positions = al.positions[cols]
    src, dist = sources(ref, cand[cols], al.positions, own=positions)
    moved = (dist <= EXACT) & (src != positions)
    if 2 * int(moved.sum()) < cols.size:
        return None
    shifts = np.unique(src[moved] - positions[moved])
    return {"sources": [int(s) if m else None for s, m in zip(src, moved)], "count": int(moved.sum()),
            "text": ", ".join(f"{p}<-{q}" for p, q in zip(positions[moved][:6], src[moved][:6])),
            "shift": f" by {int(shifts[0]):+d}" if shifts.size == 1 else ""}


def routed_to(inputs: DiagnosisInputs, layer: int | None, broken: np.ndarray, matching: np.ndarray,
              moved: np.ndarray) -> tuple[int, bool] | None:
    """(the expert, whether as the first choice) that every `broken` row chose, of the `matching` ones
    where both runs chose the same experts, and whose every such row from the first broken one to the
    last differs (`moved`: in its bits at least, a row it weighs little may stay within tolerance),
    where one is; None without experts."""
    if layer is None or "experts" not in inputs.comparison.points or layer not in inputs.comparison.layers:
        return None
    ref, cand = inputs.rows(layer, "experts")
    rows = matching & (ref == cand).all(axis=1)
    if not broken.any() or (broken & ~rows).any():
        return None
    span = np.flatnonzero(broken)
    rows[:span[0]] = rows[span[-1] + 1:] = False
    chosen = ref[rows].astype(np.int64)
    for expert in np.unique(chosen[broken[rows]]):
        for first, routed in ((False, (chosen == expert).any(axis=1)), (True, chosen[:, 0] == expert)):
            if not (broken[rows] & ~routed).any() and moved[rows][routed].all():
                return int(expert), first
    return None


def tested_rows(inputs: DiagnosisInputs, layer: int | None, tensor: str,
                cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The reference's and the candidate's `tensor` rows at `cols` (up to FACTOR_ROWS), as recorded:
    what the accounts below are tested on, read once."""
    al, cols = inputs.comparison.alignment, cols[:FACTOR_ROWS]
    return inputs.reference.point(layer, tensor, al.ref_index[cols]), inputs.candidate.point(layer, tensor,
                                                                                             al.cand_index[cols])


def stored_output(ref: np.ndarray, cand: np.ndarray, tensor: str) -> Storage | None:
    """Where the candidate's rows are the reference's stored otherwise (a narrower float, an integer
    grid with scales, another element order, one factor per head: `storage.stored_as`), that storage;
    else None."""
    return stored_as(ref, cand, tensor) if ref.shape == cand.shape and ref.ndim >= 2 else None


def output_offset(ref: np.ndarray, cand: np.ndarray) -> dict | None:
    """Where the candidate's rows (two or more) are the reference's plus one and the same vector,
    leaving at most FACTOR_LEFT of their change: {"norm", "left"}; else None."""
    if ref.shape[0] < 2:
        return None
    change = cand.astype(np.float64).reshape(cand.shape[0], -1) - ref.astype(np.float64).reshape(ref.shape[0], -1)
    offset, size = change.mean(axis=0), float(np.linalg.norm(change))
    if not np.isfinite(size) or size == 0:
        return None
    left = float(np.linalg.norm(change - offset)) / size
    return {"norm": float(np.linalg.norm(offset)), "left": left} if left <= FACTOR_LEFT else None


def row_factors(ref: np.ndarray, cand: np.ndarray) -> dict | None:
    """Where each of the candidate's rows is the reference's row times a factor of its own (least
    squares, leaving at most FACTOR_LEFT of that row's change), the factors not all one: {"min",
    "max", "left"}; else None."""
    ref = ref.astype(np.float64).reshape(ref.shape[0], -1)
    cand = cand.astype(np.float64).reshape(cand.shape[0], -1)
    power, change = (ref * ref).sum(axis=1), np.linalg.norm(cand - ref, axis=1)
    if not (np.isfinite(power).all() and np.isfinite(change).all()) or (power == 0).any() or (change == 0).any():
        return None
    factors = (cand * ref).sum(axis=1) / power
    left = np.linalg.norm(cand - factors[:, None] * ref, axis=1) / change
    if (left > FACTOR_LEFT).any() or np.ptp(factors) <= 1e-3 * np.abs(factors).max():
        return None
    return {"min": float(factors.min()), "max": float(factors.max()), "left": float(left.max())}


def output_factor(ref: np.ndarray, cand: np.ndarray) -> tuple[float, float] | None:
    """(c, share of the change left) where the candidate's rows are the reference's times one factor
    c, leaving at most FACTOR_LEFT of their difference unexplained."""
    ref, cand = ref.astype(np.float64), cand.astype(np.float64)
    return one_factor(cand, ref, float(np.linalg.norm(cand - ref)))


def one_factor(target: np.ndarray, x: np.ndarray, change: float) -> tuple[float, float] | None:
    """(c, share left) where `target` is c times `x` by least squares, leaving at most FACTOR_LEFT
    of `change` (the candidate's difference from the reference) unexplained; else None."""
    power = float((x * x).sum())
    if not (np.isfinite(change) and np.isfinite(power)) or change == 0 or power == 0:
        return None
    factor = float((target * x).sum() / power)
    left = float(np.linalg.norm(target - factor * x)) / change
    return (factor, left) if left <= FACTOR_LEFT else None

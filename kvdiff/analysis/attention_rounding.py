"""What rounding says of attention's output: the narrower float its z was kept in, proved from the rows,
or only the size a difference shares with a narrower float's rounding (a size, not a cause)."""

from __future__ import annotations

import numpy as np

from kvdiff.analysis.diagnosis import DiagnosisInputs, fmt
from kvdiff.analysis.output_accounts import tested_rows
from kvdiff.analysis.storage import UNIT_ROUNDOFF, round_to, rounding


def output_rounded(inputs: DiagnosisInputs, layer: int, cols: np.ndarray) -> tuple[dict, str] | None:
    """Where the candidate's z rows are the reference's rounded to a narrower float: the details (with
    what the rounding leaves of the change) and the evidence; else None."""
    ref, cand = tested_rows(inputs, layer, "z", cols)
    dtype, share = rounding(ref, cand)
    if dtype is None:
        return None
    left = float(np.linalg.norm(cand - round_to(ref, dtype)) / max(float(np.linalg.norm(cand - ref)), 1e-300))
    return ({"explanation": "output rounded", "rounding": dtype, "fit_residual": left},
            f": its z rows are the reference's rounded to {dtype} ({100 * share:.1f}% of the elements exactly, the "
            f"rest within one {dtype} step), attention's output kept in {dtype} before o_proj")


def rounding_note(inputs: DiagnosisInputs, attn_rel: float, details: dict) -> str:
    """Where float32 traces' attention outputs differ by about what rounding to a narrower format
    moves a row: say so (a kernel computing in it, such as a flash-attention kernel, would). `rel` is the squared
    norm of the difference over the rows' (twice the relative norm difference squared)."""
    if {inputs.reference.meta.dtype, inputs.candidate.meta.dtype} != {"float32"} or not np.isfinite(attn_rel):
        return ""
    size = float(np.sqrt(2 * attn_rel))
    fits = [(name, roundoff) for name, roundoff in UNIT_ROUNDOFF if roundoff / 16 <= size <= 4 * roundoff]
    if not fits:
        return ""
    details["rounding_size"] = fits[0][0]
    names = " or ".join(name for name, _ in fits)
    units = ", ".join(f"{name}'s unit roundoff {fmt(roundoff)}" for name, roundoff in fits)
    return (f"; the difference is as large as rounding to {names} makes it (relative {fmt(size)}; {units}): attention "
            f"computed in {names}, or K/V stored in it (a flash-attention kernel, a narrower cache), would differ by as "
            f"much, a size the data show, not a cause they prove (a small bias on the scores may be as large)"
            + ("; the data do not tell which format" if len(fits) > 1 else ""))

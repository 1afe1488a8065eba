"""Stage 1: align two traces by global position and by generated step, and give the token verdict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvdiff.trace import StepRecords, TraceMeta

TokenText = Callable[[int], str]


@dataclass(frozen=True)
class TokenDivergence:
    """The first generated step whose token differs (a token id is None where a trace stopped)."""

    step: int
    position: int                      # global position whose logits chose the token
    reference_token_id: int | None
    candidate_token_id: int | None
    reference_token: str | None
    candidate_token: str | None
    reference_margin: float | None     # top-1 minus top-2 logit of that row
    candidate_margin: float | None


@dataclass(frozen=True)
class Alignment:
    """Which rows of the two traces hold the same global position, and which may be compared."""

    positions: np.ndarray              # global positions both traces recorded, sorted
    ref_index: np.ndarray              # row of each position in the reference's arrays
    cand_index: np.ndarray             # row of each position in the candidate's arrays
    comparable_until: int | None       # first position whose inputs differ, None if all comparable
    only_reference: np.ndarray         # positions the candidate lacks
    only_candidate: np.ndarray
    prompt_length: int
    first_input_difference: int | None
    first_token_divergence: TokenDivergence | None
    tokens_identical: bool
    text_identical: bool
    kv_only: np.ndarray                # bool per aligned position: a trace read its K/V from a cache and
                                       # recorded only k and v there; its other points are not compared
    key_only: np.ndarray | None = None  # bool per aligned position: a trace computed it but kept only k and
                                        # v (a zoom window's keys); its other points are not compared

    @property
    def computed(self) -> np.ndarray:
        """Bool per aligned position: both traces computed it and recorded every point there, so every
        point can be compared."""
        return ~self.kv_only if self.key_only is None else ~(self.kv_only | self.key_only)

    @property
    def comparable(self) -> np.ndarray:
        """Bool per aligned position: its inputs are the same in both traces."""
        if self.comparable_until is None:
            return np.ones(self.positions.shape, dtype=bool)
        return self.positions < self.comparable_until


def first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    """Index of the first element where two id sequences differ (a length difference counts)."""
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    if diff.size:
        return int(diff[0])
    return None if a.size == b.size else n


def _step_margin(steps: StepRecords, step: int) -> float | None:
    hit = np.flatnonzero(steps.step == step)
    return float(steps.margin[hit[0]]) if hit.size else None


def _token_divergence(ref: TraceMeta, cand: TraceMeta, ref_steps: StepRecords, cand_steps: StepRecords,
                      text: TokenText) -> TokenDivergence | None:
    step = first_difference(ref.generated_ids, cand.generated_ids)
    if step is None:
        return None
    rid = int(ref.generated_ids[step]) if step < ref.generated_ids.size else None
    cid = int(cand.generated_ids[step]) if step < cand.generated_ids.size else None
    return TokenDivergence(
        step=step, position=int(ref.input_ids.size) + step - 1,
        reference_token_id=rid, candidate_token_id=cid,
        reference_token=None if rid is None else text(rid), candidate_token=None if cid is None else text(cid),
        reference_margin=_step_margin(ref_steps, step), candidate_margin=_step_margin(cand_steps, step))


def align(ref: TraceMeta, cand: TraceMeta, ref_positions: np.ndarray, cand_positions: np.ndarray,
          ref_steps: StepRecords, cand_steps: StepRecords, text: TokenText, rows: bool = True) -> Alignment:
    """Align by position; positions at or after the first differing input token are incomparable.
    `rows`: the positions are those of full rows, where a digest trace's key-only ones hold k and v
    only (False for its digest positions, where every point's digest is whole)."""
    common, ri, ci = np.intersect1d(ref_positions, cand_positions, assume_unique=True, return_indices=True)
    kv_only = np.isin(common, ref.kv_only_positions) | np.isin(common, cand.kv_only_positions)
    key_only = np.isin(common, ref.key_only_positions) | np.isin(common, cand.key_only_positions) if rows else None
    first_input = first_difference(ref.input_ids, cand.input_ids)
    token_div = None if first_input is not None else _token_divergence(ref, cand, ref_steps, cand_steps, text)
    if first_input is not None:
        until: int | None = first_input
    elif token_div is not None:
        until = int(ref.input_ids.size) + token_div.step
    else:
        until = None
    return Alignment(
        positions=common.astype(np.int64), ref_index=ri, cand_index=ci, comparable_until=until,
        only_reference=np.setdiff1d(ref_positions, cand_positions), only_candidate=np.setdiff1d(cand_positions, ref_positions),
        prompt_length=int(ref.input_ids.size), first_input_difference=first_input, first_token_divergence=token_div,
        tokens_identical=first_input is None and token_div is None, text_identical=ref.text == cand.text,
        kv_only=kv_only, key_only=key_only)

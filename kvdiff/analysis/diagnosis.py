"""The Diagnosis record and what every diagnosis rule reads (stage 4 input)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from kvdiff.analysis.chunks import ChunkLookup
from kvdiff.analysis.compare import Comparison, PointMap
from kvdiff.analysis.keys import KeyRows, interleaved, key_rows, rope_scale
from kvdiff.analysis.rope import estimate_thetas
from kvdiff.analysis.tolerance import Tier
from kvdiff.trace import TraceReader

KINDS = ("tokenization_mismatch", "sampling_mismatch", "position_mismatch", "rope_mismatch", "missing_context",
         "attention_mismatch", "cache_content_mismatch", "expert_flip", "operation_mismatch", "norm_consistency", "numerical_noise",
         "non_finite")


@dataclass(frozen=True)
class Diagnosis:
    """One finding: what, where (chunk, first and last global position), and why, in words and numbers.

    Every claim is checked against the tensors: `proof` is the measurement it rests on, in one
    sentence with its numbers, and `confidence` in [0, 1] how strongly that measurement carries
    it (1: shown exactly, e.g. equal inputs and a differing output; a fitted explanation: the share
    of the difference it explains, discounted by how close the next-best explanation comes)."""

    kind: str
    chunk: str | None
    positions: tuple[int, int] | None
    evidence: str
    details: dict[str, Any] = field(default_factory=dict)   # kind-specific fields (offset, unattended, ...)
    confidence: float | None = None
    proof: str | None = None

    def to_json(self) -> dict:
        out = {"kind": self.kind, "chunk": self.chunk,
               "positions": list(self.positions) if self.positions else None, "evidence": self.evidence}
        out.update(self.details)
        if self.confidence is not None:
            out["confidence"] = round(float(self.confidence), 3)
        if self.proof is not None:
            out["proof"] = self.proof
        return out


# Which diagnosis a report leads with when several are made: causes before their consequences.
PRIORITY = ("nondeterministic", "tokenization_mismatch", "non_finite", "sampling_mismatch", "logits_mismatch",
            "position_mismatch", "rope_mismatch", "cache_content_mismatch", "missing_context", "attention_mismatch",
            "expert_flip", "operation_mismatch", "norm_consistency", "numerical_noise")


def top_diagnosis(diagnoses: list[Diagnosis]) -> Diagnosis | None:
    """The diagnosis the report leads with: the highest kind in `PRIORITY`, the earliest of it; a run
    that did not repeat itself only after the first difference comes last (the rest stands), and an
    expert flip whose router input already differed (`upstream`) after the operations that caused it."""
    rank = {kind: i for i, kind in enumerate(PRIORITY)}
    consequence = rank["norm_consistency"]      # a flip that follows an earlier divergence leads after its cause
    return min(diagnoses, key=lambda d: len(PRIORITY) if d.details.get("after_first_difference")
               else consequence if d.kind == "expert_flip" and d.details.get("cause") == "upstream"
               else rank.get(d.kind, len(PRIORITY)), default=None)


@dataclass
class DiagnosisInputs:
    """The traces (re-read point by point when a rule needs raw rows), the comparison and the chunks."""

    reference: TraceReader
    candidate: TraceReader
    comparison: Comparison
    chunks: ChunkLookup
    token_text: Callable[[int], str]
    _rows: dict = field(default_factory=dict, repr=False)

    @functools.cached_property
    def sequence(self) -> np.ndarray:
        """The reference's token ids, prompt then generated: the token at each position."""
        meta = self.reference.meta
        return np.concatenate([meta.input_ids, meta.generated_ids])

    @functools.cached_property
    def first_layer(self) -> int | None:
        return self.comparison.layers[0] if self.comparison.layers else None

    def rows(self, layer: int, point: str) -> tuple[np.ndarray, np.ndarray]:
        """Reference and candidate rows of one probe point of `layer` at the aligned positions
        (only that point is read; the last four points asked for are kept)."""
        if (layer, point) not in self._rows:
            if len(self._rows) >= 4:
                self._rows.pop(next(iter(self._rows)))
            al = self.comparison.alignment
            self._rows[(layer, point)] = (self.reference.point(layer, point, al.ref_index),
                                          self.candidate.point(layer, point, al.cand_index))
        return self._rows[(layer, point)]

    @functools.cached_property
    def thetas(self) -> np.ndarray | None:
        """RoPE frequencies measured on the reference's first layer keys."""
        if self.first_layer is None or not {"k", "k_pre_rope"} <= set(self.comparison.points):
            return None
        k_pre, k = self.rows(self.first_layer, "k_pre_rope")[0], self.rows(self.first_layer, "k")[0]
        return estimate_thetas(k_pre, k, self.comparison.alignment.positions)

    @functools.cached_property
    def key_content(self) -> np.ndarray:
        """The first layer's keys before RoPE that the candidate's k rotates, per aligned position:
        its own k_pre_rope where it computed the row, the reference's where it read k from a cache
        (no k_pre_rope recorded there)."""
        k_pre_ref, k_pre_cand = self.rows(self.first_layer, "k_pre_rope")
        computed = self.comparison.alignment.computed.reshape((-1,) + (1,) * (k_pre_ref.ndim - 1))
        return np.where(computed, k_pre_cand, k_pre_ref)

    @functools.cached_property
    def keys(self) -> KeyRows | None:
        """First-layer columns whose k breaks tolerance, computed by the candidate (its k against
        its own k_pre_rope: a rotation is the candidate's own doing, whatever came before it) or,
        read from a cache, whose v matches (the magnitudes then tell whether k holds the
        reference's content), classified (see keys.py)."""
        layer, al = self.first_layer, self.comparison.alignment
        k_bad, v_ok = self.divergent("k", 0), self.ok("v", 0)
        if layer is None or k_bad is None or "k_pre_rope" not in self.comparison.points or not al.positions.size:
            return None
        cached = al.kv_only & (v_ok if v_ok is not None else False)
        cols = np.flatnonzero((al.computed | cached) & k_bad & al.comparable)
        return self._key_rows(cols, al.kv_only[cols])

    def interleaved_keys(self, cols: np.ndarray) -> KeyRows:
        """`keys`' columns `cols` classified again with RoPE's pairs taken as interleaved, (2i, 2i+1)
        (GPT-J's convention), where the reference pairs (i, i + d/2); the same frequencies."""
        return self._key_rows(cols, self.keys.cached[np.isin(self.keys.cols, cols)], interleaved)

    @functools.cached_property
    def _rope_scale(self) -> float:
        """The factor RoPE multiplies the reference's first-layer key pairs by (keys.rope_scale)."""
        al = self.comparison.alignment
        (k_pre, _), (k_ref, _) = self.rows(self.first_layer, "k_pre_rope"), self.rows(self.first_layer, "k")
        return rope_scale(k_pre[al.comparable], k_ref[al.comparable])

    def key_rows_of(self, content: np.ndarray, cols: np.ndarray) -> KeyRows:
        """The candidate's first-layer k at `cols` against `content` (per aligned position, rows
        before RoPE) instead of the content it rotates (keys.key_rows)."""
        return self._key_rows(cols, self.comparison.alignment.kv_only[cols], content=content)

    def _key_rows(self, cols: np.ndarray, cached: np.ndarray, pairing=None, content=None) -> KeyRows:
        """The first layer's k at `cols` against the content it rotates (or `content`; keys.key_rows),
        the last dimension reordered by `pairing` first where given."""
        al, tol = self.comparison.alignment, self.comparison.tolerances.for_point("k")
        content, k_cand = self.key_content if content is None else content, self.rows(self.first_layer, "k")[1]
        if pairing is not None:
            content, k_cand = pairing(content), pairing(k_cand)
        return key_rows(content, k_cand, cols, cached, self.thetas, 2 * int(al.positions.max()) + 64, tol.atol,
                        tol.rtol, (self.reference.meta.dtype, self.candidate.meta.dtype), self._rope_scale)

    def ok(self, point: str, row: int) -> np.ndarray | None:
        """Bool per aligned position: `point` at layer row `row` is bitwise or noise (None if not recorded)."""
        pmap = self.comparison.points.get(point)
        return None if pmap is None else (pmap.tier[row] == Tier.BITWISE) | (pmap.tier[row] == Tier.NOISE)

    def divergent(self, point: str, row: int) -> np.ndarray | None:
        """Bool per aligned position: `point` at layer row `row` breaches tolerance with finite values
        (NaN and Inf are the non_finite diagnosis's finding, not evidence for another rule)."""
        pmap = self.comparison.points.get(point)
        if pmap is None:
            return None
        return (pmap.tier[row] == Tier.DIVERGENT) & pmap.ref_finite[row] & pmap.cand_finite[row]

    def worst(self, point: str, row: int, cols: np.ndarray) -> tuple[float, float]:
        """Largest max_abs and rel of `point` over columns `cols` of layer row `row` (NaN where every
        row holds NaN or Inf)."""
        pmap: PointMap = self.comparison.points[point]
        worst = lambda values: float(np.fmax.reduce(values, initial=np.nan))
        return worst(pmap.max_abs[row, cols]), worst(pmap.rel[row, cols])


def group_by_chunk(inputs: DiagnosisInputs, positions: np.ndarray) -> list[tuple[str | None, np.ndarray]]:
    """Split sorted global positions by the candidate chunk that holds them, in order."""
    groups: dict[str | None, list[int]] = {}
    for p in positions.tolist():
        groups.setdefault(inputs.chunks.chunk_of(p), []).append(p)
    return sorted(((name, np.array(ps)) for name, ps in groups.items()), key=lambda g: g[1][0])


def span_text(first: int, last: int) -> str:
    return f"{first}" if first == last else f"{first}-{last}"


def fmt(x: float) -> str:
    """A number for evidence text: 3 significant digits."""
    return f"{x:.3g}"


def runs(positions: np.ndarray) -> list[tuple[int, int]]:
    """Sorted positions as [(first, last)] runs of consecutive positions."""
    out: list[tuple[int, int]] = []
    for p in positions.tolist():
        if out and p == out[-1][1] + 1:
            out[-1] = (out[-1][0], p)
        else:
            out.append((p, p))
    return out

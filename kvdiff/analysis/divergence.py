"""The Divergence: what `kvdiff.diff` returns, with its report.json form and a pandas view."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kvdiff.analysis.align import TokenDivergence
from kvdiff.analysis.attribution import Attribution
from kvdiff.analysis.compare import Comparison, PointMap
from kvdiff.analysis.diagnosis import Diagnosis, top_diagnosis
from kvdiff.analysis.operation import Operation
from kvdiff.analysis.report import SCHEMA_VERSION as REPORT_SCHEMA_VERSION, Report
from kvdiff.analysis.search import Location
from kvdiff.analysis.tolerance import Tier
from kvdiff.trace import ChunkRecord, TraceMeta

_META_FIELDS = ("model_name", "model_fingerprint", "tokenizer_fingerprint", "dtype", "device", "strategy", "numerics",
                "kvdiff_version", "torch_version", "transformers_version")
_DIMS_FIELDS = ("num_layers", "num_heads", "num_kv_heads", "head_dim")     # report.json's metadata keeps these


def _fingerprint_parts(fingerprint: str) -> tuple[str, str]:
    """A kvdiff model fingerprint's config hash and its weight hash's scheme ('w' on the host,
    'wg' on a GPU); another writer's fingerprint is all config, with no scheme."""
    config, _, weights = fingerprint.rpartition("/")
    scheme = weights.partition(":")[0]
    return (config, scheme) if config and scheme in ("w", "wg") else (fingerprint, "")


def recorded_with_different(ref: TraceMeta, cand: TraceMeta) -> list[str]:
    """What the two runs had different that no probe shows: "weights" (weights or config; only
    in one dtype, since a cast changes the bytes, and by the config alone across the host and GPU
    hash schemes) and "tokenizers". Every difference found may come from these."""
    differs = []
    a, b = ref.model_fingerprint, cand.model_fingerprint
    (config_a, scheme_a), (config_b, scheme_b) = _fingerprint_parts(a), _fingerprint_parts(b)
    weights_differ = a != b if scheme_a == scheme_b else config_a != config_b     # across schemes, the config tells
    if ref.dtype == cand.dtype and weights_differ:
        differs.append("weights")
    if ref.tokenizer_fingerprint != cand.tokenizer_fingerprint:
        differs.append("tokenizers")
    return differs


def _clean(values: np.ndarray) -> list:
    """Floats as a (nested) list with NaN/Inf as None, for strict JSON."""
    return [_clean(v) for v in values] if values.ndim > 1 else \
        [None if not math.isfinite(v) else float(v) for v in values.tolist()]


def _finite(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else float(v)


def _strict(value):
    """`value` with every NaN or Inf float (in nested dicts and lists) as None, for strict JSON."""
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return _finite(value) if isinstance(value, float) else value


def _tier_labels(tiers: np.ndarray) -> list:
    labels = {int(t): t.label for t in Tier}
    return [_tier_labels(t) for t in tiers] if tiers.ndim > 1 else [labels.get(int(t)) for t in tiers]


def _heatmap(pmap: PointMap, final: bool) -> dict:
    out = {"positions": pmap.positions.tolist()}
    if final:
        out.update(rel=_clean(pmap.rel[0]), max_abs=_clean(pmap.max_abs[0]), tiers=_tier_labels(pmap.tier[0]))
    else:
        out.update(layers=list(pmap.layers), rel=_clean(pmap.rel), max_abs=_clean(pmap.max_abs),
                   tiers=_tier_labels(pmap.tier))
    return out


@dataclass
class Divergence:
    """Where and why a candidate trace parts from the reference (see docs/report-format.md)."""

    reference: TraceMeta
    candidate: TraceMeta
    comparison: Comparison
    tokens_identical: bool
    first_bit_difference: Location | None
    first_divergence: Location | None
    first_token_divergence: TokenDivergence | None
    first_token_location: Location | None       # the logits row that chose the differing token
    diagnoses: list[Diagnosis]
    chunks: list[ChunkRecord]
    token_strings: dict[str, list[str]]         # "prompt", "reference", "candidate"
    chunk_of: dict[int, str | None] = field(default_factory=dict)
    attribution: Attribution | None = None
    first_operation: Operation | None = None     # the operation that first breaks (analysis.operation)
    recomputed: dict | None = None               # blend: which placed positions were computed again
    first_large_divergence: Location | None = None   # past a first breach of rounding size, the first far larger

    @property
    def comparable_until(self) -> int | None:
        return self.comparison.alignment.comparable_until

    def __repr__(self) -> str:
        """One line for a notebook or a log (the dataclass's own repr printed every array)."""
        def where(loc: Location | None) -> str:
            return "none" if loc is None else f"{loc.tensor} at layer {loc.layer}, position {loc.position}"

        flip = self.first_token_divergence
        return (f"<Divergence {'identical' if self.tokens_identical else 'divergent'}: "
                f"candidate {self.candidate.strategy}/{self.candidate.numerics} against "
                f"{self.reference.strategy}/{self.reference.numerics}; "
                f"first bit difference {where(self.first_bit_difference)}; "
                f"first divergence {where(self.first_divergence)}; "
                f"first token flip {'none' if flip is None else f'at step {flip.step}'}; "
                f"diagnoses {', '.join(d.kind for d in self.diagnoses) or 'none'}>")

    def to_pandas(self):
        """Long form: one row per (point, layer, position) with tier, max_abs, rel, cosine, chunk."""
        import pandas as pd

        frames = []
        maps = list(self.comparison.points.values()) + list(self.comparison.final.values())
        for pmap in maps:
            L, P = pmap.tier.shape
            frames.append(pd.DataFrame({
                "point": pmap.point,
                "layer": pd.array(np.repeat([-1 if x is None else x for x in pmap.layers], P), dtype="Int64"),
                "position": np.tile(pmap.positions, L),
                "tier": pd.Categorical(np.array(_tier_labels(pmap.tier), dtype=object).reshape(-1),
                                       categories=[t.label for t in Tier]),
                "max_abs": pmap.max_abs.reshape(-1), "rel": pmap.rel.reshape(-1), "cosine": pmap.cosine.reshape(-1),
                "chunk": np.tile(np.array([self.chunk_of.get(int(p)) for p in pmap.positions], dtype=object), L)}))
        df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
        if len(df):
            df.loc[df["layer"] == -1, "layer"] = pd.NA
        return df

    def _token_divergence_json(self) -> dict | None:
        td, loc = self.first_token_divergence, self.first_token_location
        if td is None:
            return None
        out = {"step": td.step, "position": td.position, "reference_token": td.reference_token,
               "candidate_token": td.candidate_token, "reference_token_id": td.reference_token_id,
               "candidate_token_id": td.candidate_token_id, "reference_margin": _finite(td.reference_margin),
               "candidate_margin": _finite(td.candidate_margin), "layer": None, "tensor": "logits",
               "chunk": self.chunk_of.get(td.position)}
        out.update({k: (loc.to_json()[k] if loc else None) for k in ("tier", "max_abs", "rel", "cosine")})
        return out

    def report(self, **extra) -> Report:
        """The typed report the renderers take; `extra` keys join its report.json document."""
        return Report.from_json({**self.to_json(), **extra})

    def findings_json(self) -> dict:
        """Where the runs part and why, without the per-row maps: the keys of report.json that a
        report embedding this divergence (an engine's against the reference) repeats."""
        loc = lambda x: None if x is None else x.to_json()
        return {
            "tokens_identical": self.tokens_identical,
            "first_bit_difference": loc(self.first_bit_difference),
            "first_divergence": loc(self.first_divergence),
            "first_large_divergence": loc(self.first_large_divergence),
            "first_operation": None if self.first_operation is None else self.first_operation.to_json(),
            "diagnoses": [_strict(d.to_json()) for d in self.diagnoses],     # details may hold NaN (NaN traces)
            "top_diagnosis": None if not self.diagnoses else self.diagnoses.index(top_diagnosis(self.diagnoses)),
        }

    def to_json(self) -> dict:
        """report.json (schema_version 1): strict JSON types, no NaN."""
        cmp, al = self.comparison, self.comparison.alignment
        meta = lambda m: {**{f: getattr(m, f) for f in _META_FIELDS}, **{f: getattr(m.dims, f) for f in _DIMS_FIELDS}}
        findings = self.findings_json()
        return {
            "schema_version": REPORT_SCHEMA_VERSION,
            "verdict": "identical" if self.tokens_identical else "divergent",
            "tokens_identical": findings["tokens_identical"],
            "text_identical": al.text_identical,
            "prompt": {"token_ids": self.reference.input_ids.tolist(), "tokens": self.token_strings["prompt"]},
            "conversation": [{"role": str(m.get("role")), "content": str(m.get("content"))} for m in self.reference.messages],
            "reference": {"text": self.reference.text, "token_ids": self.reference.generated_ids.tolist(),
                          "tokens": self.token_strings["reference"]},
            "candidate": {"text": self.candidate.text, "token_ids": self.candidate.generated_ids.tolist(),
                          "tokens": self.token_strings["candidate"], "strategy": self.candidate.strategy,
                          "numerics": self.candidate.numerics},
            "first_token_divergence": self._token_divergence_json(),
            **{k: findings[k] for k in ("first_bit_difference", "first_divergence", "first_large_divergence",
                                        "first_operation", "diagnoses", "top_diagnosis")},
            "chunks": [c.to_json() for c in self.chunks],
            "comparable_until": al.comparable_until,
            "first_input_difference": al.first_input_difference,
            "recorded_with_different": recorded_with_different(self.reference, self.candidate),
            "alignment": {"positions_compared": int(al.positions.size), "only_reference": al.only_reference.tolist(),
                          "only_candidate": al.only_candidate.tolist(), "prompt_length": al.prompt_length},
            "tolerances": {"default": vars(cmp.tolerances.default),
                           "per_point": {p: vars(t) for p, t in cmp.tolerances.per_point.items()}},
            "heatmaps": {p: _heatmap(m, final=False) for p, m in cmp.points.items()},
            "final": {p: _heatmap(m, final=True) for p, m in cmp.final.items()},
            "metadata": {"reference": meta(self.reference), "candidate": meta(self.candidate)},
            "attribution": None if self.attribution is None else self.attribution.to_json(),
            "recomputed": self.recomputed,
        }

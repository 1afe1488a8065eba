"""Synthetic report.json dicts shaped like the seeds' run (for report tests and README images).

30 layers, 45 positions: chunks system 0-15, user 16-27, generation prompt 28-31, generated
32-44. `seeds_report("isolated-local")` diverges at layer 0, position 16 in `k` (the user chunk
was encoded at positions 0-11); `seeds_report("prefix")` is bitwise identical.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from kvdiff.trace.points import FINAL_POINTS, LAYER_POINTS

SYSTEM = ["<|im_start|>", "system", "\n", "You", " are", " a", " helpful", " assistant", ".",
          " Always", " answer", " in", " French", ".", "<|im_end|>", "\n"]
USER = ["<|im_start|>", "user", "\n", "What", " is", " the", " capital", " of", " France", "?",
        "<|im_end|>", "\n"]
GEN_PROMPT = ["<|im_start|>", "ass", "istant", "\n"]
REFERENCE = ["La", " capit", "ale", " de", " la", " France", " est", " Paris", ".", " C", "'est",
             " une", " ville"]
CANDIDATE = ["La", " capit", "ale", " est", " est", " la", " la", " la", " capit", "ale", " de",
             " la", " la"]
LAYERS, FLIP_STEP = 30, 3
PROMPT = SYSTEM + USER + GEN_PROMPT
POSITIONS = list(range(len(PROMPT) + len(REFERENCE)))
COMPARABLE_UNTIL = len(PROMPT) + FLIP_STEP


def _cell(point: str, layer: int, position: int, divergent: bool) -> tuple[Any, Any, Any]:
    """(rel, max_abs, tier) of one cell of the isolated-local run."""
    if position >= COMPARABLE_UNTIL:
        return None, None, "incomparable"
    unaffected_at_layer0 = point in ("resid_pre", "attn_norm", "k_pre_rope", "v")
    if not divergent or position < 16 or (layer == 0 and unaffected_at_layer0):
        rel = 0.0 if layer < 8 else 3e-7 * (1 + (position * 7 + layer) % 5)
        return rel, rel * 40, "bitwise" if rel == 0 else "noise"
    rel = min(0.9, 2e-3 * math.exp(layer / 6) * (1 + (position % 5) / 4))
    return rel, rel * 60, "divergent"


def _grid(point: str, divergent: bool) -> dict[str, Any]:
    cells = [[_cell(point, layer, p, divergent) for p in POSITIONS] for layer in range(LAYERS)]
    return {"layers": list(range(LAYERS)), "positions": POSITIONS,
            "rel": [[c[0] for c in row] for row in cells],
            "max_abs": [[c[1] for c in row] for row in cells],
            "tiers": [[c[2] for c in row] for row in cells]}


def _final(divergent: bool) -> dict[str, Any]:
    cells = [_cell("final", LAYERS, p, divergent) for p in POSITIONS]
    return {"positions": POSITIONS, "rel": [c[0] for c in cells],
            "max_abs": [c[1] for c in cells], "tiers": [c[2] for c in cells]}


def _meta(strategy: str) -> dict[str, Any]:
    return {"model_name": "smollm2-135m", "dtype": "float32", "device": "cpu",
            "strategy": strategy, "numerics": "fast", "kvdiff_version": "0.1.0"}


def seeds_report(strategy: str = "isolated-local") -> dict[str, Any]:
    """A report dict of the seeds' conversation under `strategy` (isolated-local or prefix)."""
    divergent = strategy != "prefix"
    candidate = CANDIDATE if divergent else REFERENCE
    chunks = [("system", 0, 15, "hit"), ("user", 16, 27, "miss"), ("generation", 28, 31, "miss")]
    report: dict[str, Any] = {
        "schema_version": 1,
        "verdict": "divergent" if divergent else "identical",
        "tokens_identical": not divergent,
        "prompt": {"token_ids": list(range(100, 100 + len(PROMPT))), "tokens": PROMPT},
        "reference": {"text": "".join(REFERENCE), "token_ids": list(range(500, 513)),
                      "tokens": REFERENCE},
        "candidate": {"text": "".join(candidate), "tokens": candidate, "strategy": strategy,
                      "numerics": "fast",
                      "token_ids": list(range(500, 503)) + ([600] * 10 if divergent else
                                                            list(range(503, 513)))},
        "first_token_divergence": None,
        "first_bit_difference": None,
        "first_divergence": None,
        "diagnoses": [],
        "chunks": [{"name": n, "positions": [a, b], "hash": f"{i:x}" * 4 + "9c41e07bd2aa5f31",
                    "cache": c, "encoded_positions": [a - 16, b - 16] if divergent and n == "user"
                    else [a, b]} for i, (n, a, b, c) in enumerate(chunks, start=10)],
        "heatmaps": {p: _grid(p, divergent) for p in LAYER_POINTS},
        "final": {p: _final(divergent) for p in FINAL_POINTS},
        "comparable_until": COMPARABLE_UNTIL if divergent else None,
        "metadata": {"reference": _meta("reference"), "candidate": _meta(strategy)},
    }
    if divergent:
        report["first_token_divergence"] = {
            "step": FLIP_STEP, "reference_token": REFERENCE[FLIP_STEP],
            "candidate_token": CANDIDATE[FLIP_STEP], "reference_margin": 4.12,
            "candidate_margin": 0.37}
        report["first_bit_difference"] = {"layer": 0, "position": 16, "tensor": "q",
                                          "chunk": "user", "max_abs": 0.12, "rel": 2e-3}
        report["first_divergence"] = {"layer": 0, "position": 16, "tensor": "k", "chunk": "user",
                                      "tier": "divergent", "max_abs": 0.12, "rel": 2e-3}
        report["diagnoses"] = [
            {"kind": "position_mismatch", "chunk": "user", "positions": [16, 27], "offset": -16,
             "evidence": "k_pre_rope is bitwise equal at layer 0 but k differs at positions "
                         "16-27; re-rotating the candidate's k by +16 positions matches the "
                         "reference to 1e-7"},
            {"kind": "missing_context", "chunk": "user", "positions": [16, 27],
             "unattended": [0, 15],
             "evidence": "attention of positions 16-27 put 0% of its weight on positions 0-15 "
                         "(reference: 41%)"}]
    return report


def hostile_report(payload: str) -> dict[str, Any]:
    """The isolated-local report with `payload` in every piece of model, prompt and run text."""
    report = copy.deepcopy(seeds_report())
    report["prompt"]["tokens"][3] = payload
    report["reference"]["tokens"][0] = payload
    report["candidate"]["tokens"][FLIP_STEP] = payload
    report["reference"]["text"] = report["candidate"]["text"] = payload
    report["chunks"][1]["name"] = payload
    report["diagnoses"][0]["evidence"] = payload
    report["diagnoses"][0]["chunk"] = payload
    report["metadata"]["reference"]["model_name"] = payload
    report["first_token_divergence"]["candidate_token"] = payload
    report["engine"] = {"name": payload, "version": payload, "checkpoint": payload, "weights": payload,
                        "quantized": payload, "cache_hit_tokens": 16, "prompt_tokens": 28}
    report["engine_vs_reference"] = {
        "tokens_identical": False, "flip": {"kind": payload},
        "first_divergence": {"layer": 0, "position": 3, "tensor": payload, "tier": "divergent"},
        "first_operation": {"operation": payload, "layer": 0, "position": 3, "tier": "divergent", "proved": True},
        "diagnoses": [{"kind": payload, "chunk": payload, "positions": [0, 3], "evidence": payload}, payload]}
    return report

"""Missing context is named on every family as on Llama: isolated-global computes the user
message without the system prompt before it, and the diagnosis must say so (proved by attention
recomputed from the reference's tensors), not blame positions."""

from __future__ import annotations

import pytest

from conftest import SEED_MESSAGES
from kvdiff.run.compare import compare

MESSAGES = SEED_MESSAGES


@pytest.mark.parametrize("family", ["tiny-gemma3", "tiny-gpt-oss", "tiny-qwen3-moe"])
def test_isolated_global_is_missing_context_on_every_family(family, tmp_path):
    result = compare(MESSAGES, model=family, strategy="isolated-global", numerics="exact", max_new_tokens=3,
                     out=tmp_path / "run")
    report = result.report.to_json()
    user = next(c for c in report["chunks"] if c["name"] == "user")
    kinds = [d["kind"] for d in report["diagnoses"]]
    assert result.exit_code == 1
    assert report["diagnoses"][report["top_diagnosis"]]["kind"] == "missing_context"
    assert "position_mismatch" not in kinds
    context = next(d for d in report["diagnoses"] if d["kind"] == "missing_context")
    assert context["layer"] == 0 and user["positions"][0] <= report["first_bit_difference"]["position"]

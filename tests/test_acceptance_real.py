"""The seeds' scenario on the default model, end to end: what each strategy is diagnosed with."""

from pathlib import Path

import pytest

from kvdiff.run.compare import compare
from kvdiff.run.model_cache import ModelKey
from kvdiff.gate.cases import load_cases
from kvdiff.gate.runner import run_cases

from conftest import SEED_PROMPT, SEED_SYSTEM

pytestmark = pytest.mark.real_model
SEEDS = [{"role": "system", "content": SEED_SYSTEM}, {"role": "user", "content": SEED_PROMPT}]
GATE_FILE = Path(__file__).parent / "gate" / "default.toml"


@pytest.fixture(scope="module")
def models(default_model):
    """compare's model cache, holding the session's default model (one copy in a whole test run)."""
    return {ModelKey("smollm2-135m"): default_model}


def run(tmp_path, models, strategy, numerics="exact", **options):
    return compare(SEEDS, strategy=strategy, numerics=numerics, max_new_tokens=8,
                   out=tmp_path / f"{strategy}-{numerics}", model_cache=models, **options).report.to_json()


def kinds(report):
    return {d["kind"] for d in report["diagnoses"]}


def test_seed_chunks(tmp_path, models):
    report = run(tmp_path, models, "prefix")
    assert [(c["name"], c["positions"]) for c in report["chunks"]] == [
        ("system", [0, 15]), ("user", [16, 27]), ("generation", [28, 31])]
    assert report["tokens_identical"] and report["first_bit_difference"] is None


def test_prefix_fast_is_noise_only(tmp_path, models):
    report = run(tmp_path, models, "prefix", "fast")
    assert report["tokens_identical"] and report["first_divergence"] is None
    assert kinds(report) <= {"numerical_noise"}


def test_isolated_local_is_a_position_mismatch_of_the_user_chunk(tmp_path, models):
    report = run(tmp_path, models, "isolated-local")
    assert not report["tokens_identical"]
    first = report["first_divergence"]
    assert (first["layer"], first["position"], first["chunk"]) == (0, 16, "user")
    user = [d for d in report["diagnoses"] if d["kind"] == "position_mismatch" and d["chunk"] == "user"]
    assert user and user[0]["offset"] == -16


def test_isolated_global_is_missing_context_not_positions(tmp_path, models):
    report = run(tmp_path, models, "isolated-global")
    first = report["first_divergence"]
    assert (first["layer"], first["position"], first["tensor"]) == (0, 16, "z")
    assert "position_mismatch" not in kinds(report)
    user = [d for d in report["diagnoses"] if d["kind"] == "missing_context" and d["chunk"] == "user"]
    assert user and user[0]["unattended"] == [0, 15]


def test_rerotate_is_missing_context(tmp_path, models):
    report = run(tmp_path, models, "rerotate")
    assert "missing_context" in kinds(report) and "position_mismatch" not in kinds(report)


def test_blend_divergence_shrinks_as_the_recompute_ratio_grows(tmp_path, models):
    def divergent_cells(ratio):
        report = compare(SEEDS, strategy="blend", numerics="exact", recompute_ratio=ratio, max_new_tokens=8,
                         out=tmp_path / f"blend-{ratio}", model_cache=models).report.to_json()
        comparable = report["comparable_until"]
        cells = 0
        for heat in report["heatmaps"].values():
            for row in heat["tiers"]:
                cells += sum(t == "divergent" for p, t in zip(heat["positions"], row)
                             if comparable is None or p < comparable)
        return cells, report["tokens_identical"]

    # Selection ranks all 28 reused tokens; only the user chunk's 12 deviate, so from 12/28 on
    # every deviating token is recomputed and blend is bitwise the reference.
    cells = {ratio: divergent_cells(ratio) for ratio in (0.15, 0.3, 0.5, 1.0)}
    assert cells[0.15][0] > cells[0.3][0] > cells[0.5][0]
    assert cells[0.5] == cells[1.0] == (0, True)


def test_project_gate_passes_and_its_negative_control_fails(tmp_path, models):
    def loaded_once(messages, model_cache, **options):     # the gate's cases on the module's model
        return compare(messages, model_cache=models, **options)

    outcomes = run_cases(load_cases(GATE_FILE), tmp_path / "gate", compare_fn=loaded_once)
    assert [o.status for o in outcomes] == ["passed"] * len(outcomes), [o.message for o in outcomes]
    control = load_cases(GATE_FILE)[0]
    control.options["strategy"] = "isolated-local"
    (outcome,) = run_cases([control], tmp_path / "control", compare_fn=loaded_once)
    assert outcome.status == "failed"

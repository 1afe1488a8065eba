"""sampling_mismatch: a token the candidate chose that is not its own logits' top-1 (expectations
written before the first run)."""

import torch

from kvdiff.engine.sampler import Sampler
from kvdiff.run.compare import compare

SEEDS = [{"role": "system", "content": "You are a helpful assistant. Always answer in French."},
         {"role": "user", "content": "What is the capital of France?"}]


def test_a_token_not_chosen_by_argmax_is_named_with_its_step(tmp_path, monkeypatch):
    """kvdiff's engine with its sampler taking the second-best token at step 2 (its third call): every
    tensor up to the flip matches, the tokens part at step 2, and the report leads with a
    sampling_mismatch there naming the chosen token and the candidate's own top-1."""
    greedy, calls = Sampler.next_tokens, []

    def second_best_at_step_2(self, logits):
        calls.append(len(logits))
        if len(calls) == 3:
            return [int(torch.topk(row.float(), 2).indices[1]) for row in logits]
        return greedy(self, logits)

    monkeypatch.setattr(Sampler, "next_tokens", second_best_at_step_2)
    result = compare(SEEDS, model="tiny-llama", max_new_tokens=5, trace_mode="full", out=tmp_path / "run")
    report = result.report.to_json()
    assert result.exit_code == 1 and not report["tokens_identical"]
    kinds = [d["kind"] for d in report["diagnoses"]]
    assert "sampling_mismatch" in kinds, kinds
    d = report["diagnoses"][report["top_diagnosis"]]
    assert d["kind"] == "sampling_mismatch" and d["step"] == 2 and d["steps_not_argmax"] == 1, d
    assert d["chosen_token"] != d["own_top_token"] and "did not take the greedy argmax" in d["evidence"]


def test_a_greedy_candidate_gets_no_sampling_claim(tmp_path):
    result = compare(SEEDS, model="tiny-llama", max_new_tokens=3, trace_mode="full", out=tmp_path / "run")
    assert all(d["kind"] != "sampling_mismatch" for d in result.report.to_json()["diagnoses"])

"""`kvdiff compare --engine vllm` through the registry's own open_target, with a setting of the engine
that the checkpoint does not hold (vLLM's own `hf_overrides`, in every run). Apart from
tests/test_target_vllm.py, whose engine stays open for its module: each test here starts its own."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvdiff.run.compare import compare  # noqa: E402
from conftest import vllm_tiny_llama  # noqa: E402

pytestmark = pytest.mark.real_model

SYSTEM = ("You are a careful assistant. Answer briefly and precisely. When you are unsure, say so, and never "
          "invent facts. Prefer plain words over jargon.")
PROMPT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]


def test_a_sliding_window_set_in_the_engine_is_named_with_its_size(tmp_path, default_model, capfd):
    """vLLM started with `hf_overrides={"sliding_window": 16}` (the checkpoint has none, and kvdiff's
    reference attends to every earlier position): cold and warm agree; against the reference,
    expected (written after an exploratory run of the same setting on the default model):
    attention the first operation at layer 0, position 16 (the first row with a key outside the
    window), and attention_mismatch from there explained as a sliding window of 16."""
    folder = vllm_tiny_llama(tmp_path / "model", default_model)
    result = compare(PROMPT, engine="vllm", model=str(folder), max_new_tokens=6, out=tmp_path / "run",
                     engine_options={"hf_overrides": {"sliding_window": 16}})
    report = result.report.to_json()
    assert report["engine"]["options"] == {"hf_overrides": {"sliding_window": 16}}
    assert report["engine"]["cache_hit_tokens"] > 0 and report["diagnoses"] == []
    against = report["engine_vs_reference"]
    op = against["first_operation"]
    assert (op["operation"], op["layer"], op["position"], op["proved"]) == \
        ("attention (softmax(q k^T) v)", 0, 16, True), op
    first = against["diagnoses"][0]
    assert (first["kind"], first["layer"], first["positions"][0]) == ("attention_mismatch", 0, 16), against
    assert (first["explanation"], first["window"]) == ("window", 16), first
    assert "NUMA" not in capfd.readouterr().err          # vLLM's CPU worker warns in C++ on stderr: not without -vv


def test_rope_scaling_set_in_the_engine_that_drops_the_base_is_named_with_both(tmp_path, default_model):
    """vLLM started with `hf_overrides={"rope_scaling": {"rope_type": "linear", "factor": 2}}` on a
    checkpoint of RoPE base 100000: the override replaces the model's RoPE parameters, base included,
    so the engine rotates with base 10000 (the default) and positions halved. Expected (written before
    this test first ran, after an exploratory run on the default model): rope_mismatch at layer 0
    from position 1 fitting base 1e4 with linear scaling 2 against the reference's base 1e5."""
    folder = vllm_tiny_llama(tmp_path / "model", default_model, rope_theta=100000.0)
    result = compare(PROMPT, engine="vllm", model=str(folder), max_new_tokens=6, out=tmp_path / "run",
                     engine_options=['hf_overrides={"rope_scaling": {"rope_type": "linear", "factor": 2.0}}'])
    against = result.report.to_json()["engine_vs_reference"]
    rope = [d for d in against["diagnoses"] if d["kind"] in ("rope_mismatch", "position_mismatch")]
    assert rope and {d["kind"] for d in rope} == {"rope_mismatch"} and rope[0]["positions"][0] == 1, against
    for d in rope:
        assert d["layer"] == 0 and abs(d["base"] / 1e4 - 1) < 1e-3 and abs(d["reference_base"] / 1e5 - 1) < 1e-3, d
        assert abs(d["scaling_factor"] - 2) < 1e-3, d


def test_an_engine_that_runs_other_shapes_than_the_checkpoint_is_one_clear_error(tmp_path,
                                                                                   default_model):
    """vLLM started with `hf_overrides={"num_key_value_heads": 1}` on a checkpoint of two KV heads (it
    loads the first head's projection rows): its keys are not the model's shape, so no trace of the model can hold them; the run stops with an
    error that says so, and the CLI prints it as one line (exit 3)."""
    from typer.testing import CliRunner

    from kvdiff.cli import app

    folder = vllm_tiny_llama(tmp_path / "model", default_model, num_key_value_heads=2)
    result = CliRunner().invoke(app, ["compare", "--engine", "vllm", "--model", str(folder), "--prompt", "Hi there",
                                      "--max-new-tokens", "2", "--out", str(tmp_path / "run"),
                                      "--engine-option", 'hf_overrides={"num_key_value_heads": 1}'])
    assert result.exit_code == 3, result.output
    assert "what runs is not the model the trace describes" in result.stderr and result.stderr.count("\n") == 1


LONG_SYSTEM = ("You are a careful assistant. Answer briefly and precisely. When you are unsure, say so, and never "
               "invent facts. Prefer plain words over jargon, keep every answer short, and always name your sources "
               "when you can.")
LONG_PROMPT = [{"role": "system", "content": LONG_SYSTEM}, PROMPT[1]]        # 66 tokens: a hit of two 32-token blocks


def test_blocks_outside_a_sliding_window_are_not_read_as_cached_rows(tmp_path, default_model):
    """With a sliding window of 24 and a 64-token hit, vLLM keeps the warm request's first block as its
    null block (no K/V: no key of it is in any window). The target reads no rows there (it read the null
    block's bytes as cached K/V, and the zoom run then wrote a trace the reader refused). Expected
    (written after an exploratory run on the default model): cold and warm agree, and against the
    reference attention from position 24 is a sliding window of 24."""
    folder = vllm_tiny_llama(tmp_path / "model", default_model)
    result = compare(LONG_PROMPT, engine="vllm", model=str(folder), max_new_tokens=6, out=tmp_path / "run",
                     engine_options={"hf_overrides": {"sliding_window": 24}})
    report = result.report.to_json()
    assert result.exit_code == 0 and report["engine"]["cache_hit_tokens"] == 64 and report["diagnoses"] == [], report
    first = report["engine_vs_reference"]["diagnoses"][0]
    assert (first["kind"], first["positions"][0], first["explanation"], first["window"]) == \
        ("attention_mismatch", 24, "window", 24), first


def test_a_long_hit_whose_cached_values_were_rounded_is_zoomed_and_named(tmp_path, default_model, monkeypatch):
    """The warm run's cached K/V rounded through bfloat16 (every layer's cache, before the warm request):
    no token flips, the first difference is at position 0 (read from the cache), and the 64-token hit
    covers the whole default zoom window, so the window reaches the first computed position (before,
    the zoom traces held no computed row and the reader refused them). Expected (written after an
    exploratory run on the default model): cache_content_mismatch over 0-63 naming bfloat16."""
    import torch
    from kvdiff.targets import vllm as target

    generate, reset = target.VllmTarget.generate, target.VllmTarget.reset_cache
    after_reset = {"cold": False}

    def rounded_when_warm(self, *args, **kwargs):
        if not after_reset["cold"]:
            with torch.inference_mode():
                for layer in self.model.model.layers:
                    cache = layer.self_attn.attn.kv_cache
                    cache = cache if isinstance(cache, torch.Tensor) else cache[0]
                    cache.copy_(cache.to(torch.bfloat16).to(cache.dtype))
        after_reset["cold"] = False
        return generate(self, *args, **kwargs)

    def reset_cache(self):
        after_reset["cold"] = True
        return reset(self)

    monkeypatch.setattr(target.VllmTarget, "generate", rounded_when_warm)
    monkeypatch.setattr(target.VllmTarget, "reset_cache", reset_cache)
    folder = vllm_tiny_llama(tmp_path / "model", default_model)
    result = compare(LONG_PROMPT, engine="vllm", model=str(folder), max_new_tokens=6, out=tmp_path / "run")
    report = result.report.to_json()
    assert report["digest"]["zoom"]["positions"][1] >= 64, report["digest"]
    (cached,) = [d for d in report["diagnoses"] if d["kind"] == "cache_content_mismatch"]
    assert cached["positions"] == [0, 63] and cached["rounding"] == "bfloat16", cached

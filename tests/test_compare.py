"""compare, the CLI around it and the gate, end to end on tiny models."""

import json

import pytest
from typer.testing import CliRunner

from kvdiff.cli import app
from kvdiff.run.compare import compare
from kvdiff.run.folder import ARTEFACTS
from kvdiff.gate.cases import GateCase
from kvdiff.gate.runner import run_cases

runner = CliRunner()
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]


def test_prefix_exact_is_identical_with_no_bit_difference(tmp_path):
    result = compare(MESSAGES, model="tiny-llama", strategy="prefix", numerics="exact",
                     max_new_tokens=6, out=tmp_path / "run")
    assert result.exit_code == 0
    assert sorted(p.name for p in result.out_dir.iterdir()) == sorted(ARTEFACTS)
    report = json.loads(result.report_json.read_text())
    assert report["schema_version"] == 1 and report["verdict"] == "identical"
    assert report["first_bit_difference"] is None and report["first_divergence"] is None
    assert report["candidate"]["strategy"] == "prefix" and report["candidate"]["numerics"] == "exact"
    assert [c["name"] for c in report["chunks"]] == ["system", "user", "generation"]
    assert "report=" not in repr(result) and "<Divergence identical: " in repr(result)   # no megabytes in a repr


def test_report_json_puts_each_heatmap_row_and_token_list_on_one_line(tmp_path):
    result = compare(MESSAGES, model="tiny-llama", strategy="isolated-local", numerics="exact",
                     max_new_tokens=6, out=tmp_path / "run")
    text = result.report_json.read_text()
    assert json.loads(text) == result.report.to_json()
    lines = {line.strip().rstrip(",") for line in text.splitlines()}
    heatmap = result.report.to_json()["heatmaps"]["k"]
    for row in heatmap["rel"] + heatmap["max_abs"] + heatmap["tiers"]:
        assert json.dumps(row) in lines
    assert f'"token_ids": {json.dumps(result.report.to_json()["prompt"]["token_ids"])}' in lines
    assert not lines & {"0.0", "0", '"bitwise"'}     # no number or tier on a line of its own
    assert len(text) < 0.6 * len(json.dumps(result.report.to_json(), indent=2))



@pytest.mark.parametrize("strategy", ["prefix", "isolated-local", "blend"])
def test_a_compare_hashes_the_weights_once_for_the_engine_and_both_traces(tmp_path, monkeypatch, strategy):
    """Also where the zoom run builds a second engine and blend three more (~1 s each on a CPU)."""
    import kvdiff
    from kvdiff.engine import engine as engine_module
    from kvdiff.probes import model_meta
    from kvdiff.trace import fingerprint as fingerprint_module, open_trace

    hashed = []
    fingerprint = model_meta.model_fingerprint

    def counted(model):
        hashed.append(model)
        return fingerprint(model)

    for module in (model_meta, engine_module, fingerprint_module):
        monkeypatch.setattr(module, "model_fingerprint", counted)
    result = compare(MESSAGES, model="tiny-llama", strategy=strategy, max_new_tokens=2, out=tmp_path / "run")
    assert len(hashed) == 1
    assert (result.report.section("digest")["zoom"] is not None) == (strategy != "prefix")     # both diverge
    want = fingerprint(kvdiff.load_model("tiny-llama")[0])
    for path in (result.reference_trace, result.candidate_trace):
        with open_trace(path) as trace:
            assert trace.meta.model_fingerprint == want

def test_isolated_local_is_divergent_and_diagnosed(tmp_path):
    result = compare(MESSAGES, model="tiny-qwen3", strategy="isolated-local", numerics="exact",
                     max_new_tokens=6, out=tmp_path / "run")
    report = result.report.to_json()
    user = next(c for c in report["chunks"] if c["name"] == "user")
    assert report["first_bit_difference"]["layer"] == 0
    assert report["first_bit_difference"]["position"] == user["positions"][0]
    mismatch = [d for d in report["diagnoses"] if d["kind"] == "position_mismatch" and d["chunk"] == "user"]
    assert mismatch and mismatch[0]["offset"] == -user["positions"][0]


def test_empty_message_is_skipped_on_both_paths_and_reported(tmp_path):
    messages = [{"role": "system", "content": ""}, MESSAGES[1]]
    result = compare(messages, model="tiny-llama", strategy="prefix", numerics="exact",
                     max_new_tokens=4, out=tmp_path / "run")
    assert result.exit_code == 0
    assert result.report.to_json()["skipped_messages"] == [{"index": 0, "role": "system", "reason": "empty message"}]


def test_cli_compare_exit_codes_and_one_line_errors(tmp_path):
    args = ["-q", "compare", "--model", "tiny-llama", "-p", "What is the capital of France?", "-n", "4"]
    ok = runner.invoke(app, args + ["--out", str(tmp_path / "a")])
    assert ok.exit_code == 0, ok.stderr
    differ = runner.invoke(app, args + ["--strategy", "isolated-local", "--out", str(tmp_path / "b")])
    assert differ.exit_code == 1
    reused = runner.invoke(app, args + ["--out", str(tmp_path / "a")])
    assert reused.exit_code == 2 and "already holds files" in reused.stderr
    bad = runner.invoke(app, args + ["--strategy", "chunky", "--out", str(tmp_path / "c")])
    assert bad.exit_code == 2 and bad.stderr.count("\n") == 1 and "unknown strategy" in bad.stderr
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_cli_report_rerenders_a_run(tmp_path):
    compare(MESSAGES, model="tiny-llama", strategy="isolated-global", max_new_tokens=4, out=tmp_path / "run")
    (tmp_path / "run" / "report.html").unlink()
    result = runner.invoke(app, ["report", str(tmp_path / "run")])
    assert result.exit_code == 1 and "DIVERGENT" in result.stdout
    assert (tmp_path / "run" / "report.html").stat().st_size > 0


def test_gate_runs_every_case_and_keeps_reports_of_failing_ones(tmp_path):
    cases = [
        GateCase("same", MESSAGES, {"model": "tiny-llama", "strategy": "prefix", "max_new_tokens": 4}),
        GateCase("isolated", MESSAGES, {"model": "tiny-llama", "strategy": "isolated-local", "max_new_tokens": 4}),
        GateCase("broken", MESSAGES, {"model": str(tmp_path / "missing-model"), "max_new_tokens": 4}),
    ]
    outcomes = run_cases(cases, tmp_path / "gate")
    assert [o.status for o in outcomes] == ["passed", "failed", "error"]
    assert "not found" in outcomes[2].message
    assert sorted(p.name for p in (tmp_path / "gate").iterdir()) == ["isolated"]  # an error case leaves nothing
    assert (outcomes[1].report_dir / "report.html").is_file()


def test_cli_gate_junit_and_exit_code(tmp_path):
    cases = tmp_path / "cases.toml"
    cases.write_text(
        "[[case]]\nname = 'prefix'\nmodel = 'tiny-qwen2'\nprompt = 'Hello'\nmax_new_tokens = 4\n"
        "[[case]]\nname = 'control'\nmodel = 'tiny-qwen2'\nprompt = 'Hello there, what is up?'\n"
        "system = 'You are a helpful assistant.'\nstrategy = 'isolated-local'\nmax_new_tokens = 4\n"
    )
    result = runner.invoke(app, ["gate", str(cases), "--junit", str(tmp_path / "j.xml"), "--out", str(tmp_path / "o")])
    assert result.exit_code == 1, result.stderr
    assert 'failures="1"' in (tmp_path / "j.xml").read_text()


pytest_plugins = ["pytester"]


def test_pytest_plugin_fixture_passes_and_fails_with_a_report(pytester, tmp_path):
    pytester.makepyfile(
        """
        MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": "What is the capital of France?"}]

        def test_prefix(kvdiff):
            kvdiff.assert_identical(MESSAGES, model="tiny-llama", strategy="prefix", max_new_tokens=4)

        def test_isolated(kvdiff):
            kvdiff.assert_identical(MESSAGES, model="tiny-llama", strategy="isolated-local", max_new_tokens=4)
        """
    )
    reports = tmp_path / "reports"
    result = pytester.runpytest_subprocess("--kvdiff-report-dir", str(reports), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*kvdiff: tokens differ at step 0 ('*' vs '*'); first divergence at layer 0*"])
    assert (reports / "test_isolated-1" / "report.json").is_file()
    assert sorted(p.name for p in reports.iterdir()) == ["test_isolated-1"]     # a passing check leaves nothing


def _tokens_match_setup(tmp_path):
    import torch

    from kvdiff import load_model
    from kvdiff.conversation import render_prompt_ids
    from kvdiff.gate.pytest_plugin import KvdiffChecker

    model, tokenizer = load_model("tiny-llama")
    prompt = torch.tensor([render_prompt_ids(tokenizer, MESSAGES)])
    output = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False,
                            eos_token_id=None, pad_token_id=0)          # a user's engine: transformers' generate
    return KvdiffChecker(tmp_path / "reports", "t"), model, tokenizer, output, prompt.shape[1]


def test_assert_tokens_match_takes_an_engines_ids_as_list_or_tensor_and_fails_on_a_flip(tmp_path):
    checker, model, tokenizer, output, n = _tokens_match_setup(tmp_path)
    generated = output[0, n:]
    checker.assert_tokens_match(MESSAGES, generated.tolist(), model=model, tokenizer=tokenizer)
    checker.assert_tokens_match(MESSAGES, generated, model=model, tokenizer=tokenizer)
    checker.assert_tokens_match(MESSAGES, output[:, n:], model=model, tokenizer=tokenizer)     # one row of a batch
    assert not (tmp_path / "reports").exists()

    flipped = generated.tolist()
    flipped[2] = (flipped[2] + 1) % tokenizer.vocab_size
    with pytest.raises(pytest.fail.Exception) as failure:
        checker.assert_tokens_match(MESSAGES, flipped, model=model, tokenizer=tokenizer)
    message = str(failure.value)
    assert f"tokens differ at step 2: reference {generated[2].item()} " in message
    assert f" vs engine {flipped[2]} " in message
    assert (tmp_path / "reports" / "t-1" / "reference.h5").is_file()


@pytest.mark.parametrize("ids, words", [
    (None, "got NoneType"),
    ("hello", "got str"),
    ([1, 2.5], "must hold ints, got 2.5"),
    ([[1, 2], [3, 4]], "holds 2 rows"),
])
def test_assert_tokens_match_refuses_what_is_not_one_conversations_ids(tmp_path, ids, words):
    from kvdiff.errors import InputError

    checker, model, tokenizer, _, _ = _tokens_match_setup(tmp_path)
    with pytest.raises(InputError, match=words):
        checker.assert_tokens_match(MESSAGES, ids, model=model, tokenizer=tokenizer)


def test_assert_tokens_match_names_the_prompt_when_given_generates_whole_output(tmp_path):
    from kvdiff.errors import InputError

    checker, model, tokenizer, output, n = _tokens_match_setup(tmp_path)
    with pytest.raises(InputError, match=rf"begins with the prompt's {n} tokens: .* output\[0, {n}:\]"):
        checker.assert_tokens_match(MESSAGES, output[0], model=model, tokenizer=tokenizer)


def test_the_zoom_window_holds_a_divergence_after_noise_not_the_noise():
    """Red-team round 5, t53 and t56: the first bits to part are not proved beyond tolerance (noise, or a
    digest difference of unknown size, at layer 0) and a later layer's rows are: the window holds the
    divergence, where the diagnoses can name it; a divergence inside the first difference's window
    keeps that window."""
    from types import SimpleNamespace

    import numpy as np

    from kvdiff.analysis.search import Location
    from kvdiff.analysis.tolerance import Tier
    from kvdiff.run.zoom import zoom_window

    def first_pass(bits_tier, divergent_layer, length=100):
        tiers = np.full((30, length), Tier.BITWISE, dtype=np.int8)
        tiers[0, :] = bits_tier
        tiers[divergent_layer, 62:] = Tier.DIVERGENT
        cmp = SimpleNamespace(points={"v": SimpleNamespace(layers=list(range(30)), tier=tiers)},
                              alignment=SimpleNamespace(positions=np.arange(length), computed=np.arange(length) >= 62))
        bits, breach = (Location(layer, position, "v", None, tier.label, 0.0, 0.0, None)
                        for layer, position, tier in ((0, 0, bits_tier), (divergent_layer, 62, Tier.DIVERGENT)))
        return SimpleNamespace(comparison=cmp, first_bit_difference=bits, first_divergence=breach)

    assert zoom_window(first_pass(Tier.NOISE, 20), 30).layers == (19, 21)
    # red-team round 6, t01: the breach inside the noise's window, near its end: the window reaches
    # 64 positions past it (its rows are what the diagnoses test), not only to the noise's 64th
    assert zoom_window(first_pass(Tier.NOISE, 1, length=200), 30).positions == (0, 125)
    # red-team round 6, t06: a final point's breach (the final norm at a decode row) needs the last
    # layer, whose resid_post is the final norm's input: the window moves there
    final = first_pass(Tier.NOISE, 1)
    final.comparison.points["v"].tier[1] = Tier.BITWISE         # no layer breaches: the final norm does
    final.first_divergence = Location(None, 30, "final_norm", None, Tier.DIVERGENT.label, 0.0, 0.0, None)
    assert zoom_window(final, 30).layers == (28, 29)
    assert zoom_window(first_pass(Tier.DIFFERENT, 20), 30).layers == (19, 21)
    assert zoom_window(first_pass(Tier.DIFFERENT, 1), 30).layers == (0, 1)


def test_a_zoom_window_past_its_start_keeps_the_keys_attention_read_where_attention_parts_first():
    """Red-team round 5, t02: where the window starts at the first difference (past ZOOM_FROM_START)
    and that difference is attention's output, the window keeps k and v at every earlier position
    (its keys, up to MAX_KEY_POSITIONS); not where another point parts first, nor where it starts at 0."""
    from types import SimpleNamespace

    import numpy as np

    from kvdiff.analysis.search import Location
    from kvdiff.analysis.tolerance import Tier
    from kvdiff.run.zoom import MAX_KEY_POSITIONS, zoom_window

    def first_pass(point, position, length):
        tiers = np.full((4, length), Tier.BITWISE, dtype=np.int8)
        tiers[1, position:] = Tier.DIVERGENT
        cmp = SimpleNamespace(points={point: SimpleNamespace(layers=list(range(4)), tier=tiers)},
                              alignment=SimpleNamespace(positions=np.arange(length), computed=np.ones(length, bool)))
        cell = Location(1, position, point, None, Tier.DIVERGENT.label, 1.0, 1.0, None)
        return SimpleNamespace(comparison=cmp, first_bit_difference=cell, first_divergence=cell)

    window = zoom_window(first_pass("z", 600, 700), 4)
    assert window.positions == (600, 663) and window.keys == (0, 599)
    assert window.row_args() == {"layers": "0-2", "positions": "600-663", "key_positions": "0-599"}
    assert window.to_json()["key_positions"] == [0, 599]
    assert zoom_window(first_pass("attn_out", 600, 700), 4).keys == (0, 599)
    assert zoom_window(first_pass("v", 600, 700), 4).keys is None          # the rows that part are in the window
    assert zoom_window(first_pass("z", 100, 700), 4).keys is None          # the window starts at 0
    far = MAX_KEY_POSITIONS + 10
    assert zoom_window(first_pass("z", far, far + 20), 4).keys is None
    # red-team round 7, t04b: the window placed by a later breach (a router at layer 3) whose first
    # differing layer parts first at attention's output keeps the keys too
    later = first_pass("z", 600, 700)
    tiers = np.full((4, 700), Tier.BITWISE, dtype=np.int8)
    tiers[3, 600:] = Tier.DIVERGENT
    later.comparison.points["router_logits"] = SimpleNamespace(layers=list(range(4)), tier=tiers)
    later.first_divergence = Location(3, 600, "router_logits", None, Tier.DIVERGENT.label, 1.0, 1.0, None)
    later.first_bit_difference = Location(1, 600, "z", None, Tier.NOISE.label, 1e-7, 1e-9, None)
    assert zoom_window(later, 4).keys == (0, 599)

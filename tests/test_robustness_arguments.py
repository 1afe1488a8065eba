"""Robustness, arguments: bad options are refused with one line, exit 2, before any work."""

from __future__ import annotations

import pytest
import torch

from robustness import MESSAGES, assert_error, assert_no_finished_run, cli, compare_args

# (id, extra compare arguments, what the error line says)
BAD_OPTIONS = [
    ("unknown-strategy", ["--strategy", "chunky"], "unknown strategy 'chunky': use one of none, prefix"),
    ("unknown-numerics", ["--numerics", "approx"], "unknown numerics 'approx': use one of exact, fast"),
    ("negative-tokens", ["-n", "-3"], "max_new_tokens must be between 1 and 100000, got -3"),
    ("zero-tokens", ["-n", "0"], "max_new_tokens must be between 1 and 100000, got 0"),
    ("huge-tokens", ["-n", str(10 ** 20)], "max_new_tokens must be between 1 and 100000"),
    ("tokens-not-a-number", ["-n", "ten"], "Invalid value for '--max-new-tokens'"),
    ("zero-chunk-size", ["--chunk-size", "0"], "chunk_size must be a positive number of tokens"),
    ("negative-chunk-size", ["--chunk-size", "-5"], "chunk_size must be a positive number of tokens"),
    ("ratio-above-one", ["--recompute-ratio", "1.5"], "recompute_ratio must be in [0, 1]"),
    ("ratio-nan", ["--recompute-ratio", "nan"], "recompute_ratio must be in [0, 1], got nan"),
    ("unknown-capture-point", ["--capture", "k,kv"], "unknown probe point(s) kv"),
    ("unknown-heatmap-point", ["--point", "kv"], "--point 'kv' is not a layer probe point"),
    ("unknown-option", ["--frobnicate"], "No such option: --frobnicate; see `kvdiff compare --help`"),
    ("unknown-dtype", ["--dtype", "float8"], "unknown dtype 'float8'"),
    ("unknown-device", ["--device", "tpu"], "unknown device 'tpu'"),
    ("messages-and-prompt", ["--messages", "m.json", "-p", "hi"], "give either --messages or --prompt/--system"),
    ("unknown-device-map", ["--device-map", "everywhere"], "unknown device map 'everywhere': use one of auto"),
    ("gpu-memory-alone", ["--gpu-memory", "20GiB"], "only applies to a model split with --device-map"),
    ("gpu-memory-not-a-size", ["--device-map", "auto", "--gpu-memory", "lots"], "'lots' is not a size: write it like"),
]


@pytest.mark.parametrize("extra, message", [row[1:] for row in BAD_OPTIONS], ids=[row[0] for row in BAD_OPTIONS])
def test_bad_option_fails_before_any_work(tmp_path, monkeypatch, extra, message):
    monkeypatch.chdir(tmp_path)
    assert_error(cli(*compare_args(tmp_path / "run", *extra)), 2, message)
    assert not (tmp_path / "run").exists() and not (tmp_path / "kvdiff-runs").exists()


def test_no_prompt_at_all(tmp_path):
    result = cli("compare", "--model", "tiny-llama", "--out", tmp_path / "run")
    assert_error(result, 2, "no prompt: give --prompt TEXT")
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_cuda_without_a_gpu(tmp_path):
    assert_error(cli(*compare_args(tmp_path / "run", "--device", "cuda")), 2, "no CUDA GPU is visible: use --device cpu")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("layers, message", [
    ("0-99", "layer(s) 0-99 out of range: the model has layers 0-2"),
    ("0-99999999999999", "layer(s) 0-99999999999999 out of range"),   # refused before the range is expanded
    ("2,7,9", "layer(s) 7 out of range"),
    ("abc", "bad layer 'abc'"),
    ("3-1", "bad layer range '3-1'"),
], ids=["beyond-last", "huge-range", "some-beyond", "not-a-number", "reversed"])
def test_layers_out_of_range_or_malformed(tmp_path, layers, message):
    assert_error(cli(*compare_args(tmp_path / "run", "--trace-mode", "full", "--layers", layers)), 2, message)
    assert_no_finished_run(tmp_path / "run")
    assert not (tmp_path / "run").exists()   # the folder the run created is removed again


@pytest.mark.parametrize("args, message", [
    (["diff"], "Missing argument 'reference'"),
    (["gate"], "Missing argument 'cases_file'"),
    (["nosuchcommand"], "No such command 'nosuchcommand'"),
], ids=["diff-without-traces", "gate-without-cases", "unknown-command"])
def test_usage_errors_are_one_line(args, message):
    assert_error(cli(*args), 2, message, "--help`")


def test_json_or_html_into_a_missing_folder_fails_before_the_run(tmp_path):
    for option in ("--json", "--html"):
        result = cli(*compare_args(tmp_path / "run", option, tmp_path / "no" / "such" / "file"))
        assert_error(result, 2, f"folder {tmp_path / 'no' / 'such'} does not exist")
        assert not (tmp_path / "run").exists()


# ---- issue #28 ---------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["k=nan", "k=0,nan", "k=inf", "logits=1e-4,inf", "k=-1"])
def test_a_tolerance_that_is_not_a_finite_number_is_refused(tmp_path, spec):
    """`--tolerance k=nan` was accepted (while -1 was refused): NaN fails every comparison."""
    from synthetic import SyntheticModel, write_trace

    model = SyntheticModel(layers=2, seed=1)
    traces = [write_trace(model, tmp_path / f"{name}.h5", list(range(3, 13)), 2) for name in ("a", "b")]
    assert_error(cli("diff", *traces, "--tolerance", spec, "--json", tmp_path / "r.json"), 2,
                 f"bad tolerance {spec!r}; write POINT=ATOL[,RTOL] with finite numbers >= 0")
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("bad", [10 ** 12, -1], ids=["huge", "negative"])
def test_assert_tokens_match_refuses_ids_outside_the_vocabulary(tmp_path, bad):
    """An id of 10**12 raised a bare OverflowError from the tokenizer's decode."""
    import kvdiff
    from kvdiff.errors import InputError
    from kvdiff.gate.pytest_plugin import KvdiffChecker

    model, tokenizer = kvdiff.load_model("tiny-llama")
    checker = KvdiffChecker(tmp_path / "reports", "t")
    with pytest.raises(InputError, match=rf"token_ids holds {bad} at step 1, outside the model's vocabulary 0\.\.\d+"):
        checker.assert_tokens_match(MESSAGES, [5, bad, 7], model=model, tokenizer=tokenizer)
    assert not (tmp_path / "reports").exists()

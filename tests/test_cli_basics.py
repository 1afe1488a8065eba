import json
import re
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

import kvdiff
from kvdiff.cli import app

runner = CliRunner()


def test_help_lists_every_command():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for name in ("compare", "diff", "report", "inspect", "gate", "bench"):
        assert name in result.output


def test_every_option_help_shows_as_written():
    """Help is rich markup: `[[case]]` showed as `[]` until its brackets were escaped."""
    import typer.main

    group = typer.main.get_group(app)
    for name, command in group.commands.items():
        shown = " ".join(runner.invoke(app, [name, "--help"], env={"COLUMNS": "2000"}).output.split())
        for param in command.params:
            if param.help:
                assert param.help.replace("\\[", "[") in shown, (name, param.help)


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"kvdiff {kvdiff.__version__}"


@pytest.mark.parametrize("module", ["kvdiff", "kvdiff.cli"])
def test_console_script_runs(module):
    out = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and kvdiff.__version__ in out.stdout


def test_the_api_functions_stay_functions_when_their_modules_are_imported():
    """`from kvdiff.run.compare import CompareResult` used to turn `kvdiff.compare` into the module."""
    code = ("import kvdiff\nfrom kvdiff.run.compare import CompareResult\nimport kvdiff.run.record, kvdiff.analysis\n"
            "print(*(callable(getattr(kvdiff, name)) for name in ('compare', 'record', 'diff', 'load_model')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["True"] * 4, out.stderr


@pytest.mark.parametrize("args, says", [
    (["diff", "missing.h5", "other.h5"], "trace missing.h5 not found"),
    (["inspect", "missing.h5"], "trace missing.h5 not found"),
    (["compare", "--prompt", "hi", "--strategy", "bogus"], "unknown strategy 'bogus'"),
    (["compare", "--strategy", "isolated-local"], "no prompt"),
    (["compare", "--prompt", "hi", "--layers", "0-3"], "layers select what a full trace records"),
    (["compare", "--prompt", "hi", "--capture", "bogus"], "bogus"),
    (["gate", "missing.toml"], "case file missing.toml not found"),
    (["compare", "--prompt", "hi", "--model", "missing-folder"], "model 'missing-folder' not found"),
    (["generate", "--prompt", "hi", "--model", "missing.gguf"], "model 'missing.gguf' not found"),
])
def test_a_bad_input_is_answered_before_torch_and_transformers_load(tmp_path, args, says):
    """Their import takes seconds: an error a user can fix at once must not wait for them."""
    code = ("import runpy, sys\nsys.argv = ['kvdiff', *sys.argv[1:]]\ntry:\n    runpy.run_module('kvdiff', "
            "run_name='__main__')\nexcept SystemExit as exc:\n    print('exit', exc.code, *sorted({'torch', "
            "'transformers', 'h5py'} & set(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=tmp_path)
    assert out.stdout.split() == ["exit", "2"], (out.stdout, out.stderr)
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("kvdiff: error: ") and says in out.stderr


def test_generate_with_missing_model_is_one_line_exit_2(tmp_path):
    result = runner.invoke(app, ["generate", "-p", "hi", "--model", str(tmp_path / "missing")])
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0
    assert "not found" in result.stderr


def test_generate_on_tiny_model():
    result = runner.invoke(app, ["generate", "-p", "What is the capital of France?", "--model", "tiny-qwen2", "-n", "4"])
    assert result.exit_code == 0, result.stderr


def test_a_piped_stderr_gets_no_spinner_only_the_error_line(tmp_path):
    """Without -q, stderr that is not a terminal (a pipe, a CI log) holds nothing from the
    progress spinner: a successful run leaves it empty, a failing one leaves the one error line."""
    base = [sys.executable, "-m", "kvdiff", "compare", "--model", "tiny-llama", "-n", "2", "-p", "hi"]
    ok = subprocess.run([*base, "--out", str(tmp_path / "run")], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr
    bad = subprocess.run([*base, "--strategy", "sideways"], capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 2
    assert bad.stderr.startswith("kvdiff: error: unknown strategy 'sideways'") and bad.stderr.count("\n") == 1, bad.stderr



@pytest.mark.parametrize("command", [["compare", "--out", "{tmp}/run"], ["generate"]])
def test_a_reader_that_stops_reading_leaves_the_exit_code_alone(tmp_path, command):
    """`kvdiff compare ... | head`: stdout's reader is gone before the report is printed. The
    run still ends with its own exit code (0: tokens identical), not 1 ("tokens differ"), and
    stderr holds no traceback."""
    args = [a.replace("{tmp}", str(tmp_path)) for a in command]
    proc = subprocess.Popen([sys.executable, "-m", "kvdiff", *args, "--model", "tiny-llama", "-n", "2", "-p", "hi"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert proc.wait() == 0, stderr
    assert stderr == ""
    if command[0] == "compare":
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
            "candidate.h5", "reference.h5", "report.html", "report.json"]

@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA this would run the whole GPU benchmark")
def test_bench_skips_the_gpu_benchmark_without_cuda_and_says_why():
    out = subprocess.run([sys.executable, "-m", "kvdiff", "bench", "gpu"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "needs a CUDA GPU" in out.stderr
    assert "skipped benchmark(s) gpu" in out.stderr


def test_bench_of_an_unknown_name_lists_the_benchmarks_and_exits_2():
    result = runner.invoke(app, ["bench", "nosuch"])
    assert result.exit_code == 2
    assert "unknown benchmark(s) nosuch" in result.stderr and "gpu" in result.stderr


def test_quiet_and_verbose_work_after_the_command_name_and_a_value_stays_a_value(tmp_path):
    base = ["compare", "--model", "tiny-llama", "-n", "1"]
    quiet = runner.invoke(app, [*base, "-p", "hi", "-o", str(tmp_path / "a"), "-q"])
    assert quiet.exit_code == 0 and quiet.stdout == "", quiet.output
    verbose = subprocess.run([sys.executable, "-m", "kvdiff", *base, "-p", "hi", "-o", str(tmp_path / "b"), "-v"],
                             capture_output=True, text=True)     # a child: logging is configured once a process
    assert verbose.returncode == 0 and "INFO kvdiff" in verbose.stderr and "IDENTICAL" in verbose.stdout
    stages = [line for line in verbose.stderr.splitlines() if "INFO kvdiff: " in line]
    times = [int(re.match(r"\s*(\d+)ms INFO ", line).group(1)) for line in stages]      # ms since start
    assert len(times) >= 4 and times == sorted(times), verbose.stderr
    as_prompt = runner.invoke(app, [*base, "-p", "-q", "-o", str(tmp_path / "c")])     # the prompt is "-q"
    assert as_prompt.exit_code == 0 and "IDENTICAL" in as_prompt.stdout
    report = json.loads((tmp_path / "c" / "report.json").read_text())
    assert "-q" in "".join(report["prompt"]["tokens"])
    after_dashes = runner.invoke(app, [*base, "-p", "hi", "--", "-q"])
    assert after_dashes.exit_code == 2 and "unexpected extra argument" in after_dashes.stderr

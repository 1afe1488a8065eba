import subprocess
import sys

import pytest
from typer.testing import CliRunner

import kvdiff
from kvdiff.cli import app

runner = CliRunner()


def test_help_lists_every_command():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for name in ("compare", "diff", "report", "inspect", "gate", "bench"):
        assert name in result.output


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"kvdiff {kvdiff.__version__}"


@pytest.mark.parametrize("module", ["kvdiff", "kvdiff.cli"])
def test_console_script_runs(module):
    out = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and kvdiff.__version__ in out.stdout


def test_generate_with_missing_model_is_one_line_exit_2(tmp_path):
    result = runner.invoke(app, ["generate", "-p", "hi", "--model", str(tmp_path / "missing")])
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0
    assert "not found" in result.stderr


def test_generate_on_tiny_model():
    result = runner.invoke(app, ["generate", "-p", "What is the capital of France?", "--model", "tiny-qwen2", "-n", "4"])
    assert result.exit_code == 0, result.stderr

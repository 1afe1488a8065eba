"""Robustness, gate: malformed case files, and cases that crash while the others still run."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvdiff.errors import InputError
from kvdiff.gate.cases import GateCase, load_cases
from kvdiff.gate.runner import run_cases
from robustness import MESSAGES, assert_error, cli

GOOD_CASE = "[[case]]\nname = 'ok'\nmodel = 'tiny-llama'\nprompt = 'Hello'\nmax_new_tokens = 2\n"


@pytest.mark.parametrize("text, message", [
    ("[[case]\nname = 'x'", "is not valid TOML"),
    ("title = 'x'\n" + GOOD_CASE, "unknown top-level key(s) title: only [[case]] tables"),
    (GOOD_CASE + "colour = 'red'\n", "case 1 has unknown key(s) colour: known keys are"),
    (GOOD_CASE.replace("max_new_tokens = 2", "max_new_tokens = 'two'"), "`max_new_tokens` has the wrong type (str)"),
    ("", "holds no [[case]] tables"),
    (GOOD_CASE + GOOD_CASE, "duplicate case name(s) ok"),
], ids=["not-toml", "unknown-top-level-key", "unknown-case-key", "wrong-type", "no-cases", "duplicate-names"])
def test_malformed_case_file_is_refused_before_anything_runs(tmp_path, text, message):
    cases = tmp_path / "cases.toml"
    cases.write_text(text, encoding="utf-8")
    result = cli("gate", cases, "--out", tmp_path / "out", "--junit", tmp_path / "junit.xml")
    assert_error(result, 2, message)
    assert not (tmp_path / "out").exists() and not (tmp_path / "junit.xml").exists()


def test_gate_out_folder_holding_files_is_refused(tmp_path):
    cases = tmp_path / "cases.toml"
    cases.write_text(GOOD_CASE, encoding="utf-8")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old").write_text("x")
    assert_error(cli("gate", cases, "--out", tmp_path / "out"), 2, "already holds files")


def _fake_compare(outcomes: dict[str, object]):
    """A compare_fn that raises or returns per case (by the case's model option)."""
    def run(messages, out: Path, model_cache: dict, model: str) -> SimpleNamespace:
        result = outcomes[model]
        if isinstance(result, BaseException):
            raise result
        out.mkdir(parents=True)
        return SimpleNamespace(divergence=SimpleNamespace(tokens_identical=result), summary="tokens differ")
    return run


def test_a_crashing_case_is_an_error_case_and_the_others_still_run(tmp_path):
    cases = [GateCase(name, MESSAGES, {"model": name}) for name in ("before", "crash", "bad-input", "after")]
    fake = _fake_compare({"before": True, "crash": ZeroDivisionError("division by zero"),
                          "bad-input": InputError("model 'x' not found"), "after": False})
    outcomes = run_cases(cases, tmp_path / "gate", compare_fn=fake)
    assert [o.status for o in outcomes] == ["passed", "error", "error", "failed"]
    assert outcomes[1].message == "ZeroDivisionError: division by zero"
    assert outcomes[2].message == "model 'x' not found"


def test_case_names_that_clean_to_one_folder_get_a_folder_each(tmp_path):
    cases = [GateCase(name, MESSAGES, {"model": "differ"}) for name in ("a b", "a_b", "a/b", "a_b-2")]
    outcomes = run_cases(cases, tmp_path / "gate", compare_fn=_fake_compare({"differ": False}))
    assert [o.status for o in outcomes] == ["failed"] * 4
    assert [o.report_dir.name for o in outcomes] == ["a_b", "a_b-2", "a_b-3", "a_b-2-2"]


def test_cli_gate_reports_an_error_case_and_runs_the_rest(tmp_path):
    cases = tmp_path / "cases.toml"
    cases.write_text("[[case]]\nname = 'bad'\nmodel = 'tiny-llama'\nprompt = 'Hi'\nstrategy = 'chunky'\n"
                     + GOOD_CASE, encoding="utf-8")
    result = cli("gate", cases, "--out", tmp_path / "out", "--junit", tmp_path / "junit.xml")
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    root = ET.parse(tmp_path / "junit.xml").getroot()
    assert (root.attrib["tests"], root.attrib["errors"], root.attrib["failures"]) == ("2", "1", "0")
    error = {c.attrib["name"]: c for c in root.iter("testcase")}["bad"].find("error")
    assert "unknown strategy 'chunky'" in error.attrib["message"]
    assert list((tmp_path / "out").iterdir()) == []     # the passing case's folder is removed, the error left none


def test_case_file_with_a_byte_order_mark_is_read(tmp_path):
    cases = tmp_path / "cases.toml"
    cases.write_bytes(b"\xef\xbb\xbf" + GOOD_CASE.encode("utf-8"))
    assert [c.name for c in load_cases(cases)] == ["ok"]

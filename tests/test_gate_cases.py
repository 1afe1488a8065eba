import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvdiff.errors import InputError
from kvdiff.gate.cases import load_cases
from kvdiff.gate.runner import CaseOutcome, write_junit

GATE_FILE = Path(__file__).parent / "gate" / "default.toml"


def write(tmp_path, text, name="cases.toml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_project_gate_file_parses():
    cases = load_cases(GATE_FILE)
    assert [c.options["strategy"] for c in cases] == ["prefix"] * len(cases)
    assert {c.options["numerics"] for c in cases} == {"exact", "fast"}
    assert cases[2].messages[-1] == {"role": "user", "content": "And of Germany?"}


@pytest.mark.parametrize(
    "text, message",
    [
        ("[[case]\nname='x'", "not valid TOML"),
        ("title = 'x'", "unknown top-level key"),
        ("", "no [[case]] tables"),
        ("[[case]]\nprompt='hi'", "non-empty string `name`"),
        ("[[case]]\nname='a'\nprompt='hi'\nstrategy='prefix'\ncolour='red'", "unknown key(s) colour"),
        ("[[case]]\nname='a'\nprompt='hi'\nmax_new_tokens='ten'", "`max_new_tokens` has the wrong type"),
        ("[[case]]\nname='a'\nprompt='hi'\n[[case]]\nname='a'\nprompt='ho'", "duplicate case name(s) a"),
        ("[[case]]\nname='a'", "no prompt"),
        ("[[case]]\nname='a'\nmessages=[{role='robot', content='hi'}]", "unknown role 'robot'"),
        ("[[case]]\nname='a'\nprompt='hi'\nmessages=[{role='user', content='hi'}]", "either `messages` or"),
    ],
)
def test_malformed_case_files_are_one_clear_input_error(tmp_path, text, message):
    with pytest.raises(InputError) as info:
        load_cases(write(tmp_path, text))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_non_utf8_and_missing_case_files(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xff\xfe[[case]]")
    with pytest.raises(InputError, match="not UTF-8"):
        load_cases(bad)
    with pytest.raises(InputError, match="not found"):
        load_cases(tmp_path / "missing.toml")


def test_junit_has_one_testcase_per_case_with_failures_and_errors(tmp_path):
    outcomes = [
        CaseOutcome("ok", "passed", 1.0, "tokens identical"),
        CaseOutcome("flip", "failed", 2.0, "tokens differ at step 0", tmp_path / "flip"),
        CaseOutcome("boom", "error", 0.5, "model 'x' not found"),
    ]
    path = tmp_path / "out" / "junit.xml"
    write_junit(outcomes, path)
    root = ET.parse(path).getroot()
    assert root.attrib["tests"] == "3" and root.attrib["failures"] == "1" and root.attrib["errors"] == "1"
    cases = {c.attrib["name"]: c for c in root.iter("testcase")}
    assert cases["flip"].find("failure") is not None and "flip" in cases["flip"].find("failure").text
    assert cases["boom"].find("error").attrib["message"] == "model 'x' not found"
    assert cases["ok"].find("failure") is None and cases["ok"].find("error") is None

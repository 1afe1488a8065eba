"""The rich terminal report: contents, NO_COLOR, narrow terminals, bucketing, bad input."""

from __future__ import annotations

import io

import pytest
from report_samples import hostile_report, seeds_report
from rich.cells import cell_len
from rich.console import Console

from kvdiff.analysis.report import Report
from kvdiff.errors import InputError
from kvdiff.reports import render_terminal
from kvdiff.reports.heatmap_text import allocate, buckets


def _text(report: dict, width: int = 100, **kwargs) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    render_terminal(Report.from_json(report), console, **kwargs)
    return console.export_text()


def test_divergent_report_contents():
    text = _text(seeds_report())
    assert "DIVERGENT — tokens differ from step 3" in text
    assert "» de«" in text and "» est«" in text  # first divergent token marked on both sides
    assert "heatmap: k " in text  # default point: the first tolerance breach's tensor
    assert "position_mismatch" in text and "offset=-16" in text
    assert "re-rotating the candidate's k by" in text
    assert "missing_context" in text and "unattended=0–15" in text
    assert "step 3: ' de' -> ' est'" in text
    assert "k at layer 0, position 16 '<|im_start|>', chunk user" in text
    chunk_rows = [line.split() for line in text.splitlines() if "bbbb9c41" in line]
    assert chunk_rows == [["user", "16–27", "bbbb9c41", "miss", "0–11", "≠", "positions"]]


def test_identical_report_contents():
    text = _text(seeds_report("prefix"))
    assert "IDENTICAL — tokens identical" in text
    assert "bitwise identical through every probe" in text
    assert "»" not in text.split("heatmap")[0]
    assert "█" not in text.split("heatmap")[1].split("· bitwise")[0]  # no divergent cell


def test_heatmap_rows_and_chunk_boundaries():
    rows = {line.split()[0]: line for line in _text(seeds_report()).splitlines()
            if line.strip().startswith(("L0 ", "L29 ", "norm ", "logit "))}
    assert set(rows) == {"L0", "L29", "norm", "logit"}
    cells = rows["L0"].split(maxsplit=1)[1]
    system, user, generation, generated = cells.split("│")
    assert system == "·" * 16 and user == "█" * 12 and generation == "█" * 4
    assert generated == "█" * 3 + "/" * 10  # incomparable after the token flip


def test_no_color_emits_no_ansi(monkeypatch):
    def render() -> str:
        out = io.StringIO()
        render_terminal(Report.from_json(seeds_report()), Console(file=out, force_terminal=True, width=100))
        return out.getvalue()

    monkeypatch.delenv("NO_COLOR", raising=False)
    assert "\x1b[" in render()
    monkeypatch.setenv("NO_COLOR", "1")
    plain = render()
    assert "\x1b" not in plain
    assert "» est«" in plain and "█" in plain  # meaning survives without colour


@pytest.mark.parametrize("width", [60, 40])
def test_narrow_terminal(width):
    text = _text(seeds_report(), width=width)
    assert max(cell_len(line) for line in text.splitlines()) <= width
    heat_rows = [line for line in text.splitlines() if line.strip().startswith("L0 ")]
    assert len(heat_rows) == 1 and heat_rows[0].count("│") == 3
    assert "position_mismatch" in text and "DIVERGENT" in text
    if width == 40:
        assert "positions/column, worst shown" in " ".join(text.split())


def test_allocate_and_buckets():
    assert allocate([16, 12, 4, 13], 100) == [16, 12, 4, 13]
    counts = allocate([1000, 3, 1], 20)
    assert sum(counts) == 20 and counts[1] >= 1 and counts[2] == 1
    parts = buckets(list(range(10)), 3)
    assert [p for part in parts for p in part] == list(range(10)) and len(parts) == 3


def test_bucket_shows_worst_tier():
    report = seeds_report("prefix")
    grid = report["heatmaps"]["k"]
    grid["tiers"][0][5], grid["rel"][0][5] = "divergent", 0.5
    row = next(line for line in _text(report, width=40).splitlines() if line.strip().startswith("L0 "))
    assert row.count("█") == 1


def test_point_choice_and_errors():
    assert "heatmap: v " in _text(seeds_report(), point="v")
    with pytest.raises(InputError, match="no heatmap for probe point 'nope'.*have: resid_pre"):
        _text(seeds_report(), point="nope")
    with pytest.raises(InputError, match="schema_version 2 is not supported"):
        _text({**seeds_report(), "schema_version": 2})


def test_minimal_report_renders():
    text = _text({"schema_version": 1, "verdict": "identical", "tokens_identical": True})
    assert "IDENTICAL" in text and "heatmap" not in text


def test_hostile_text_is_inert(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    out = io.StringIO()
    render_terminal(Report.from_json(hostile_report("\x1b[2J[bold]x[/bold]")), Console(file=out, force_terminal=True))
    text = out.getvalue()
    assert "\x1b" not in text
    assert "\\x1b[2J[bold]x[/bold]" in text


def test_prints_only_through_console(capsys):
    render_terminal(Report.from_json(seeds_report()), Console(file=io.StringIO(), width=80))
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_a_chunk_start_too_wide_for_its_columns_is_cut_with_an_ellipsis():
    report = seeds_report("prefix")
    heat = report["heatmaps"]["k"]
    heat["positions"] = [p + 1500 for p in heat["positions"]]     # starts of four digits
    for chunk in report["chunks"]:
        chunk["positions"] = [p + 1500 for p in chunk["positions"]]
    text = _text(report, width=40)
    names, starts = next(lines for lines in zip(text.splitlines(), text.splitlines()[1:])
                         if lines[1].split("│")[0].strip() == "1500")
    cells = [cell.strip() for cell in starts.split("│")]
    assert cells[0] == "1500" and all(cell in ("1516", "1528", "1532") or cell.endswith("…") for cell in cells[1:])
    assert any(cell.endswith("…") for cell in cells[1:])                   # one cut, marked as cut
    assert all("generation".startswith(name.strip()) or "generated".startswith(name.strip())
               for name in names.split("│")[2:])                          # names are cut, no ellipsis

"""blend checked position by position: report.json `blend_errors`, and its terminal and HTML renderings."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from chromium import CHROMIUM, load

from kvdiff.analysis.report import Report
from kvdiff.reports.blend import BlendErrors, blend_errors_text
from kvdiff.reports.html import write_html
from kvdiff.reports.terminal import render_terminal
from kvdiff.run.compare import compare

SEEDS = [{"role": "system", "content": "You are a helpful assistant. Always answer in French."},
         {"role": "user", "content": "What is the capital of France?"}]
PLACED = 29     # tiny-llama: 16 system + 13 user tokens, every chunk but the generation prompt


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("blend")
    return {ratio: compare(SEEDS, model="tiny-llama", strategy="blend", recompute_ratio=ratio, numerics="exact",
                           max_new_tokens=3, out=out / str(ratio))
            for ratio in (0.15, 1.0)}


def _section(result):
    return json.loads(result.report_json.read_text())["blend_errors"]


def test_recomputed_positions_are_mended_and_the_others_keep_isolated_global_error(runs):
    be = _section(runs[0.15])
    assert be["point"] == "k" and be["positions"] == list(range(PLACED))
    again = [p for p, r in zip(be["positions"], be["recomputed"]) if r]
    assert again == runs[0.15].report.to_json()["recomputed"]["positions"] and len(again) == 5   # ceil(0.15 x 29)
    blend, local, global_ = be["blend"], be["isolated-local"], be["isolated-global"]
    # the system chunk sits at 0..15 alone or not: every strategy computes its K exactly
    assert blend[:16] == local[:16] == global_[:16] == [0.0] * 16
    for p in again:
        assert blend[p] == 0.0 or blend[p] < min(local[p], global_[p]) / 10, p
    assert sum(blend[p] == 0.0 for p in again) >= 3
    for p in set(range(16, PLACED)) - set(again):
        # not recomputed: the user chunk's K computed alone and re-rotated, as isolated-global computes it
        assert global_[p] > 0.01 and blend[p] == pytest.approx(global_[p], rel=1e-3), p
    assert all(local[p] > 0.1 for p in range(16, PLACED))      # encoded at 0..12 instead of 16..28


def test_at_ratio_one_every_placed_position_is_exact(runs):
    be = _section(runs[1.0])
    assert be["recomputed"] == [True] * PLACED
    assert be["blend"] == [0.0] * PLACED
    assert min(be["isolated-global"][16:]) > 0 and min(be["isolated-local"][16:]) > 0


def test_other_strategies_have_no_blend_errors(tmp_path):
    result = compare(SEEDS, model="tiny-llama", strategy="isolated-global", numerics="exact", max_new_tokens=2,
                     out=tmp_path / "run")
    assert "blend_errors" not in json.loads(result.report_json.read_text())


def test_the_terminal_summary_fits_80_columns(runs):
    console = Console(file=io.StringIO(), width=80, no_color=True, color_system=None)
    render_terminal(runs[0.15].report, console)
    lines = console.file.getvalue().splitlines()
    assert max(map(len, lines)) <= 80
    start = next(i for i, line in enumerate(lines) if line.startswith("blend vs isolated"))
    rows = {" ".join(line.split()[:3]): line.split()[3:] for line in lines[start + 2:start + 7] if "(" in line}
    assert list(rows) == ["system kept (16)", "user recomputed (5)", "user kept (8)"]
    assert rows["system kept (16)"] == ["0", "/", "0"] * 3
    be = _section(runs[0.15])
    again = [i for i, r in enumerate(be["recomputed"]) if r]
    assert rows["user recomputed (5)"][:3] == ["0", "/", f"{max(be['blend'][i] for i in again):.3g}"]
    assert rows["user kept (8)"][:3] == rows["user kept (8)"][6:]        # blend kept = isolated-global
    assert "at 5 of 5 recomputed positions" in " ".join(" ".join(lines[start:]).split())


@pytest.mark.skipif(not CHROMIUM.exists(), reason="/usr/bin/chromium absent: run scripts/setup.sh --test")
def test_the_html_report_lists_every_placed_position(runs, tmp_path):
    loaded = load(runs[0.15].report_html)
    assert "data-errors" not in loaded.html_attrs and loaded.console_errors == []
    assert "at most both isolated strategies' at 5 of 5 recomputed positions (of 29 placed)" in loaded.dom
    table = loaded.dom.split('<table id="blend">')[1].split("</table>")[0]
    rows = table.split("<tr>")[2:]
    assert len(rows) == PLACED and sum("<td class=\"mono\">yes</td>" in row for row in rows) == 5
    other = load(write_html(Report.from_json({"schema_version": 1, "verdict": "identical", "tokens_identical": True}),
                            tmp_path / "other.html"))
    assert '<section hidden=""><h2>blend, position by position' in other.dom


@pytest.mark.parametrize("section", [None, [], {"positions": [0, 1]}, {"positions": [0], "recomputed": [True],
                                     "blend": [0.0], "isolated-local": [], "isolated-global": [1.0]},
                                     {"positions": ["0"], "recomputed": [1], "blend": [0], "isolated-local": [0],
                                      "isolated-global": [0]}])
def test_a_malformed_section_renders_nothing(section):
    assert BlendErrors.of(section) is None and blend_errors_text(section) is None


def test_missing_numbers_render_as_a_dash():
    view = {"positions": [3, 4], "recomputed": [True, False], "blend": [0.0, None],
            "isolated-local": [0.5, 0.25], "isolated-global": [0.4, "x"]}
    assert BlendErrors.of(view).mended() == 1
    console = Console(file=io.StringIO(), width=80, no_color=True, color_system=None)
    console.print(blend_errors_text(view, plain=True))
    out = console.file.getvalue()
    assert "0 / 0" in out and "0.5 / 0.5" in out and "–" in out and "at 1 of 1 recomputed" in " ".join(out.split())

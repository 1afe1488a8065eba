"""The HTML report in headless Chromium: it draws, logs no error, and can be screenshotted."""

from __future__ import annotations

import pytest
from chromium import CHROMIUM, load, screenshot
from report_samples import LAYERS, POSITIONS, hostile_report, seeds_report

from kvdiff.reports.html import render_html, write_html
from kvdiff.analysis.report import Report

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="/usr/bin/chromium absent: run scripts/setup.sh (apt-get install chromium) to enable",
)


def test_report_draws_without_errors(tmp_path):
    page = write_html(Report.from_json(seeds_report()), tmp_path / "report.html")
    loaded = load(page)
    assert "data-errors" not in loaded.html_attrs and loaded.console_errors == []
    assert loaded.body_attrs["data-ready"] == "1" and loaded.body_attrs["data-point"] == "k"
    assert int(loaded.body_attrs["data-cells-drawn"]) == (LAYERS + 2) * len(POSITIONS)
    assert int(loaded.body_attrs["data-nonblank-pixels"]) > 10_000
    png = screenshot(page, tmp_path / "report.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_hostile_text_stays_text_in_the_browser(tmp_path):
    page = write_html(Report.from_json(hostile_report("</script><img src=x onerror=alert(1)>")), tmp_path / "h.html")
    loaded = load(page)
    assert "data-errors" not in loaded.html_attrs and loaded.console_errors == []
    assert "<img" not in loaded.dom and "&lt;img src=x onerror=alert(1)&gt;" in loaded.dom


def test_harness_sees_script_errors_and_csp_refusals(tmp_path):
    """Negative control: a broken data block and an injected inline script are both reported."""
    page = render_html(Report.from_json(seeds_report()))
    broken = tmp_path / "broken.html"
    broken.write_text(page.replace('{"report"', '{"report""', 1), encoding="utf-8")
    loaded = load(broken)
    assert "SyntaxError" in loaded.html_attrs["data-errors"] and loaded.console_errors
    injected = tmp_path / "injected.html"
    injected.write_text(page.replace("<main>", "<main><script>document.title='x'</script>", 1),
                        encoding="utf-8")
    assert "CSP violation: script-src" in load(injected).html_attrs["data-errors"]


def test_report_without_heatmaps_loads(tmp_path):
    minimal = {"schema_version": 1, "verdict": "identical", "tokens_identical": True}
    loaded = load(write_html(Report.from_json(minimal), tmp_path / "minimal.html"))
    assert "data-errors" not in loaded.html_attrs and loaded.console_errors == []
    assert loaded.body_attrs["data-ready"] == "1" and "no heatmap in this report" in loaded.dom


def test_report_of_a_real_compare_run_draws_without_errors(tmp_path):
    from kvdiff.run.compare import compare

    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"}]
    result = compare(messages, model="tiny-llama", strategy="isolated-local", max_new_tokens=4, out=tmp_path / "run")
    loaded = load(result.report_html)
    assert "data-errors" not in loaded.html_attrs and loaded.console_errors == []
    assert loaded.body_attrs["data-ready"] == "1"
    heat = result.report.to_json()["heatmaps"][loaded.body_attrs["data-point"]]
    assert int(loaded.body_attrs["data-cells-drawn"]) == (len(heat["layers"]) + 2) * len(heat["positions"])


def test_a_report_of_different_prompts_or_tokenizers_says_so_in_its_verdict(tmp_path):
    report = dict(seeds_report(), first_input_difference=16, recorded_with_different=["tokenizers"])
    loaded = load(write_html(Report.from_json(report), tmp_path / "prompts.html"))
    assert "data-errors" not in loaded.html_attrs and loaded.console_errors == []
    assert "DIVERGENT — inputs differ from position 16" in loaded.dom
    assert "the traces are of different prompts: positions from 16 on are not compared" in loaded.dom
    assert "recorded with different tokenizers: differences may come from them" in loaded.dom
    without_chunks = dict(report, diagnoses=[dict(report["diagnoses"][0], chunk=None)])
    loaded = load(write_html(Report.from_json(without_chunks), tmp_path / "no-chunks.html"))
    assert '<p class="meta">positions 16–27</p>' in loaded.dom and "chunk – · " not in loaded.dom


def test_chunk_names_of_narrow_chunks_take_a_second_lane_or_are_left_out_never_overlap(tmp_path):
    import json

    report = seeds_report("prefix")
    chunk = report["chunks"][0]
    report["chunks"] = [dict(chunk, name=f"chunk{i}", positions=[i, i], encoded_positions=[i, i]) for i in range(6)]
    report["chunks"].append(dict(chunk, name="rest", positions=[6, 31], encoded_positions=[6, 31]))
    loaded = load(write_html(Report.from_json(report), tmp_path / "narrow.html"))
    assert "data-errors" not in loaded.html_attrs and loaded.console_errors == []
    labels = json.loads(loaded.body_attrs["data-chunk-labels"])
    assert [label["text"] for label in labels][:7] == [f"chunk{i} @{i}" for i in range(6)] + ["rest @6"]
    assert {label["lane"] for label in labels} == {-1, 0, 1}        # both lanes used, some names left out
    for lane in (0, 1):
        drawn = [label for label in labels if label["lane"] == lane]
        assert all(b["x0"] >= a["x1"] + 5 for a, b in zip(drawn, drawn[1:])), drawn


def test_the_header_answers_before_the_heatmap_and_opens_on_the_telling_point(tmp_path):
    """The operation that breaks and the top diagnosis are in the page's header, above the
    heatmap, and the heatmap opens on k (k_pre_rope equal, k different), as a screenshot shows."""
    from kvdiff.run.compare import compare

    seeds = [{"role": "system", "content": "You are a helpful assistant. Always answer in French."},
             {"role": "user", "content": "What is the capital of France?"}]
    result = compare(seeds, model="tiny-llama", strategy="isolated-local", numerics="fast", max_new_tokens=3,
                     out=tmp_path / "run")
    page = load(result.report_html)
    header = page.dom[page.dom.index('<header id="verdict"'):page.dom.index("</header>")]
    assert "first breaks: RoPE (on q and k) at layer 0, position 16" in header
    assert "diagnosis: position_mismatch, chunk user, positions 16–" in header and "offset -16" in header
    assert page.dom.index("</header>") < page.dom.index('id="heatmap"')
    assert page.body_attrs["data-point"] == "k" and not page.console_errors
    png = screenshot(result.report_html, tmp_path / "header.png", width=1200, height=500)
    assert png.stat().st_size > 10_000

"""The HTML report: escaping of hostile text, CSP, no network resource, atomic writes."""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re

import pytest
from report_samples import hostile_report, seeds_report

from kvdiff.errors import InputError
from kvdiff.reports.html import render_html, write_html
from kvdiff.analysis.report import Report

HOSTILE = "</script><img src=x onerror=alert(1)>&amp;\u2028\u2029<!--"


def _block(page: str, opening: str) -> str:
    start = page.index(opening) + len(opening)
    return page[start: page.index("</", start)]


def _data(page: str) -> dict:
    return json.loads(_block(page, '<script type="application/json" id="kvdiff-data">'))


def test_hostile_text_is_escaped_and_survives():
    page = render_html(Report.from_json(hostile_report(HOSTILE)))
    assert "<img" not in page and "<!--" not in page
    assert page.count("</script>") == 2  # the data block's and the page script's own
    assert "\u2028" not in page and "\u2029" not in page
    report = _data(page)["report"]
    assert report["prompt"]["tokens"][3] == HOSTILE
    assert report["diagnoses"][0]["evidence"] == HOSTILE
    assert report["chunks"][1]["name"] == HOSTILE


def test_title_is_escaped():
    report = seeds_report()
    report["candidate"]["strategy"] = HOSTILE
    page = render_html(Report.from_json(report))
    title = page[page.index("<title>"): page.index("</title>")]
    assert "<img" not in title and "&lt;/script&gt;" in title


def test_csp_forbids_everything_external_and_hashes_match():
    page = render_html(Report.from_json(seeds_report()))
    csp = re.search(r'<meta http-equiv="Content-Security-Policy" content="([^"]+)">', page).group(1)
    csp = csp.replace("&#x27;", "'")
    assert csp.startswith("default-src 'none';") and "unsafe-inline" not in csp
    assert "base-uri 'none'" in csp and "form-action 'none'" in csp
    for directive, code in (("script-src", _block(page, "<script>")),
                            ("style-src", _block(page, "<style>"))):
        digest = base64.b64encode(hashlib.sha256(code.encode()).digest()).decode()
        assert f"{directive} 'sha256-{digest}'" in csp
    assert page.index("Content-Security-Policy") < page.index("<style>")


def test_no_network_resource_references():
    page = render_html(Report.from_json(seeds_report()))
    assert "http:" not in page and "https:" not in page
    assert not re.search(r"\s(src|href|action|srcset|poster)\s*=", page, re.IGNORECASE)
    for needle in ("url(", "@import", "fetch(", "XMLHttpRequest", "import(", "Worker(",
                   "WebSocket", "innerHTML", "outerHTML", "insertAdjacentHTML", "document.write"):
        assert needle not in page, needle


def test_non_finite_numbers_stay_valid_json():
    report = seeds_report()
    report["heatmaps"]["k"]["rel"][0][16] = math.inf
    report["heatmaps"]["k"]["max_abs"][0][16] = math.nan
    report["heatmaps"]["k"]["rel"][0][17] = 0.0012345678
    raw = _block(render_html(Report.from_json(report)), '<script type="application/json" id="kvdiff-data">')
    data = json.loads(raw, parse_constant=lambda name: pytest.fail(f"bare {name} in JSON"))
    row = data["report"]["heatmaps"]["k"]
    assert row["rel"][0][16] == "Infinity" and row["max_abs"][0][16] == "NaN"
    assert row["rel"][0][17] == 0.001235


def test_payload_points_and_default():
    data = _data(render_html(Report.from_json(seeds_report())))
    assert data["points"][:5] == ["resid_pre", "attn_norm", "q", "k_pre_rope", "k"]
    assert data["default_point"] == "k"


def test_minimal_report_renders():
    data = _data(render_html(Report.from_json({"schema_version": 1, "verdict": "identical", "tokens_identical": True})))
    assert data["points"] == [] and data["default_point"] is None


def test_write_html_atomic(tmp_path):
    target = write_html(Report.from_json(seeds_report()), tmp_path / "report.html")
    assert target.read_text(encoding="utf-8").startswith("<!doctype html>")
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]
    before = target.read_text(encoding="utf-8")
    with pytest.raises(InputError, match="schema_version 0 is not supported"):
        write_html(Report.from_json({**seeds_report(), "schema_version": 0}), target)
    assert target.read_text(encoding="utf-8") == before
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]
    with pytest.raises(InputError, match="cannot write the HTML report"):
        write_html(Report.from_json(seeds_report()), tmp_path / "missing" / "report.html")

"""The self-contained HTML report: one file, inline CSS and JS, no network resource of any kind.

The report's data is embedded as JSON in a `<script type="application/json">` block (with `<`,
`>`, `&` escaped, and every non-ASCII character, U+2028/2029 included, as a \\u escape) and the
page script builds the DOM from it with textContent only.

The page script is kvdiff/reports/heatmap.js then report.js, as one inline `<script>`.
Content-Security-Policy: `default-src 'none'` with the one inline script and the one inline
style allowed by their sha256 hashes. Hashes rather than 'unsafe-inline': if some model text
ever escaped its JSON block, an injected script or style would still not run; rather than a
nonce: the file is static (no server to mint a nonce per response), so a hash binds exactly the
code kvdiff ships and keeps the output reproducible.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import os
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any

from kvdiff.errors import KvdiffError
from kvdiff.files import write_text_atomically
from kvdiff.analysis.report import Report
from kvdiff.reports.printable import printable

_ASSETS = resources.files("kvdiff.reports")


def _asset(name: str) -> str:
    return _ASSETS.joinpath(name).read_text(encoding="utf-8")


def _csp_hash(code: str) -> str:
    digest = hashlib.sha256(code.encode("utf-8")).digest()
    return "'sha256-" + base64.b64encode(digest).decode("ascii") + "'"


def _portable(value: Any) -> Any:
    """JSON-safe copy: floats to 4 significant digits, non-finite floats as JS number names."""
    if isinstance(value, float):
        if math.isfinite(value):
            return float(f"{value:.4g}")
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {str(k): _portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_portable(v) for v in value]
    return value


def embed_json(data: Any) -> str:
    """JSON that is inert inside a `<script>` element of an HTML document."""
    text = json.dumps(data, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def render_html(view: Report) -> str:
    """The HTML report of `view` as one string."""
    payload = {"report": _portable(view.to_json()), "points": view.points(),
               "default_point": view.default_point()}
    style = _asset("report.css")
    script = _asset("heatmap.js") + "\n" + _asset("report.js")
    if "</" in script or "</" in style:
        raise KvdiffError("kvdiff/reports assets must not contain '</' (it would end their element)")
    csp = (f"default-src 'none'; script-src {_csp_hash(script)}; style-src {_csp_hash(style)}; "
           "base-uri 'none'; form-action 'none'")
    candidate = view.section("candidate")
    title = f"kvdiff report: {view.verdict} ({candidate.get('strategy', '?')})"
    return Template(_asset("report.html")).substitute(
        csp=html.escape(csp, quote=True), title=html.escape(printable(title, keep="")), style=style, script=script,
        data=embed_json(payload))


def write_html(report: Report, path: str | os.PathLike[str]) -> Path:
    """Write the HTML report to `path` atomically (temporary file, then rename); returns it."""
    return write_text_atomically(path, render_html(report), "the HTML report")

"""Render the README's example images: the terminal report (text) and the HTML report.

    python scripts/render_examples.py [RUN/report.json]

Without an argument it renders the synthetic seeds-like report of tests/report_samples.py.
Writes docs/images/terminal-report.txt and, when
/usr/bin/chromium exists, docs/images/report.png (a 1400x1500 screenshot of the HTML report).
"""

from __future__ import annotations

import io
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from chromium import CHROMIUM, screenshot  # noqa: E402
from report_samples import seeds_report  # noqa: E402
from rich.console import Console  # noqa: E402

from kvdiff.analysis.report import Report  # noqa: E402
from kvdiff.reports import render_terminal, write_html  # noqa: E402

IMAGES = ROOT / "docs" / "images"


def main(argv: list[str]) -> int:
    report = Report.from_json(json.loads(Path(argv[0]).read_text(encoding="utf-8")) if argv else seeds_report())
    IMAGES.mkdir(parents=True, exist_ok=True)
    console = Console(record=True, width=100, file=io.StringIO(), force_terminal=True,
                      color_system="truecolor")
    render_terminal(report, console)
    (IMAGES / "terminal-report.txt").write_text(console.export_text(clear=False), encoding="utf-8")
    written = ["terminal-report.txt"]
    if CHROMIUM.exists():
        with tempfile.TemporaryDirectory() as tmp:
            page = write_html(report, Path(tmp) / "report.html")
            screenshot(page, IMAGES / "report.png", width=1400, height=1500)
        written.append("report.png")
    else:
        sys.stderr.write("chromium absent: docs/images/report.png not rendered\n")
    sys.stdout.write("".join(f"wrote {IMAGES / name}\n" for name in written))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

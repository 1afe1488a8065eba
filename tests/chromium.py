"""Drive headless Chromium (Debian's /usr/bin/chromium) without selenium: DOM dump and screenshot.

Used by the HTML report's browser test and by scripts/render_examples.py.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
          "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
          "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000"]
# Console errors, uncaught exceptions and CSP refusals as Chromium logs them on stderr.
_CONSOLE_ERROR = re.compile(r"Uncaught|Refused to|CONSOLE\(\d+\).*(error|Error)|:ERROR:CONSOLE")


@dataclass(frozen=True)
class Page:
    """What a loaded page left behind: its DOM, html and body attributes, console errors."""

    dom: str
    html_attrs: dict[str, str]
    body_attrs: dict[str, str]
    console_errors: list[str]


class _Attrs(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.found: dict[str, dict[str, str]] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("html", "body") and tag not in self.found:
            self.found[tag] = {k: v or "" for k, v in attrs}


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="kvdiff-chromium-") as profile:
        return subprocess.run([str(CHROMIUM), *_FLAGS, f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=60, check=True)


def load(html_file: Path) -> Page:
    """Open `html_file`, let its scripts run, and read back the DOM and the console errors."""
    done = _run(["--dump-dom", html_file.resolve().as_uri()])
    parser = _Attrs()
    parser.feed(done.stdout)
    errors = [line for line in done.stderr.splitlines() if _CONSOLE_ERROR.search(line)]
    return Page(done.stdout, parser.found.get("html", {}), parser.found.get("body", {}), errors)


def screenshot(html_file: Path, png: Path, width: int = 1400, height: int = 1000) -> Path:
    """Save a `width` x `height` screenshot of `html_file` to `png`."""
    _run([f"--window-size={width},{height}", f"--screenshot={png.resolve()}",
          html_file.resolve().as_uri()])
    if not png.is_file():
        raise RuntimeError(f"chromium wrote no screenshot to {png}")
    return png

"""Report renderers: the rich terminal report and the self-contained HTML report."""

from kvdiff.reports.html import render_html, write_html
from kvdiff.reports.terminal import render_terminal

__all__ = ["render_terminal", "render_html", "write_html"]

"""Report renderers: the rich terminal report and the self-contained HTML report."""

from kvdiff.reports.terminal import render_terminal

__all__ = ["render_terminal"]

"""Report renderers: the rich terminal report and the self-contained HTML report.

The exports load on first use, so that the CLI's error line (`printable`) does not load them.
"""

from kvdiff.exports import lazy_exports

_EXPORTS = {"render_terminal": "kvdiff.reports.terminal", "render_html": "kvdiff.reports.html",
            "write_html": "kvdiff.reports.html"}

__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)

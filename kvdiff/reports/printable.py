"""Text from a trace, a report or a model made safe to print."""

from __future__ import annotations

import unicodedata


def printable(text: str, keep: str = "\n\t") -> str:
    """`text` with control characters, line or paragraph separators (other than those in `keep`) and
    lone surrogates (undecodable bytes) shown as escapes."""
    return "".join(
        c if c in keep or unicodedata.category(c) not in ("Cc", "Cs", "Zl", "Zp") else repr(c)[1:-1] for c in text
    )

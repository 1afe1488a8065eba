"""report.json as text: indented for reading, with every list of numbers or strings on one line.

`json.dumps(indent=2)` puts each number of a heatmap on a line of its own, which made the
report of a 1,500-token prompt 26 MB (9 MB of them needed) and took Python's slow encoder.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvdiff.files import write_text_atomically

_INDENT = "  "


def _is_flat(value: list) -> bool:
    return not any(isinstance(item, (dict, list)) for item in value)


def _text(value: object, depth: int) -> str:
    inner = _INDENT * (depth + 1)
    if isinstance(value, dict) and value:
        items = (f"{inner}{json.dumps(str(key), ensure_ascii=False)}: {_text(item, depth + 1)}"
                 for key, item in value.items())
        return "{\n" + ",\n".join(items) + "\n" + _INDENT * depth + "}"
    if isinstance(value, list) and value and not _is_flat(value):
        return "[\n" + ",\n".join(inner + _text(item, depth + 1) for item in value) + "\n" + _INDENT * depth + "]"
    return json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(", ", ": "))


def report_json_text(data: dict) -> str:
    """Strict JSON (no NaN) of `data`: objects indented, flat lists (heatmap rows, token ids) on one line."""
    return _text(data, 0) + "\n"


def write_json_atomically(data: dict, path: Path) -> None:
    """Write `report_json_text(data)` under a temporary name, then rename."""
    write_text_atomically(path, report_json_text(data), "report.json")

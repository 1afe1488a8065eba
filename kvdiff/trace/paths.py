"""What a trace's path must be before its file is opened; light, so the CLI checks it before it
loads the stages that read traces."""

from __future__ import annotations

import os
from pathlib import Path

from kvdiff.errors import TraceError

PARTIAL_SUFFIX = ".partial"     # a trace's name while its writer works: renamed only once complete


def check_trace_path(path: str | os.PathLike[str]) -> Path:
    """`path` as a Path, once it names an existing file that is not a writer's unfinished one;
    else a TraceError saying what to do."""
    path = Path(path)
    if not path.exists():
        raise TraceError(f"trace {path} not found: check the path, or record it first")
    if not path.is_file():
        raise TraceError(f"trace {path} is not a file")
    if path.name.endswith(PARTIAL_SUFFIX):
        raise TraceError(f"trace {path} is incomplete: its writer did not finish (killed or failed); record it again")
    return path

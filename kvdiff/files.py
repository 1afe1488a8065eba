"""Writing report files so that a reader never sees a half-written one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kvdiff.errors import InputError, KvdiffError


def write_text_atomically(path: str | os.PathLike[str], text: str, what: str) -> Path:
    """Write `text` to `path` through a unique temporary file in the same folder, then rename.

    `what` names the file in errors ("the HTML report"). A missing or unwritable folder is an
    InputError; a failure while writing (disk full) is a KvdiffError; no temporary file is left.
    """
    target = Path(path)
    try:
        fd, temp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise InputError(f"cannot write {what} to {target}: {exc.strerror}") from exc
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(temp, 0o644)
        os.replace(temp, target)
    except OSError as exc:
        Path(temp).unlink(missing_ok=True)
        raise KvdiffError(f"cannot write {what} to {target}: {exc.strerror}") from exc
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return target

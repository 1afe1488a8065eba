"""Writing report files so that a reader never sees a half-written one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kvdiff.errors import InputError, KvdiffError


def check_folder_of(path: str | os.PathLike[str], what: str) -> None:
    """InputError unless the folder `path` would be written into exists and is writable.

    For outputs written at the end of a long run: a typo in the path fails before the run.
    """
    folder = Path(path).parent
    if not folder.is_dir():
        raise InputError(f"cannot write {what} to {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise InputError(f"cannot write {what} to {path}: folder {folder} is not writable")


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

"""Writing report files so that a reader never sees a half-written one (a temporary file, then a
rename), and to stdout, pipes and terminals as they are."""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

from kvdiff.errors import InputError, KvdiffError


def stdout_gone() -> None:
    """The reader of stdout has gone (`kvdiff compare ... | head`): what is still to be printed
    goes to /dev/null, so the command ends with its own exit code rather than an error."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


@contextlib.contextmanager
def stderr_silenced(silence: bool = True) -> Iterator[None]:
    """While the block runs (where `silence`), what native code writes to stderr (file descriptor 2)
    goes to /dev/null: an engine's C++ extension warns there, past Python's logging and warnings.
    Exceptions still carry their messages. Where fd 2 cannot be duplicated, nothing changes."""
    try:
        saved = os.dup(2) if silence else None
    except OSError:
        saved = None
    if saved is None:
        yield
        return
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def is_stdout(path: str | os.PathLike[str]) -> bool:
    """Whether writing `path` writes stdout: `-`, or a name of the file stdout is (`/dev/stdout`)."""
    if str(path) == "-":
        return True
    try:
        return os.path.samestat(os.stat(path), os.fstat(sys.stdout.fileno()))
    except (OSError, ValueError):
        return False


def in_place(path: Path) -> bool:
    """Whether `path` is written where it is rather than through a temporary file and a rename:
    an existing file, or link to one, that is not a regular file (a terminal, a pipe,
    `/dev/stdout`), which a rename would replace with a regular file."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def landing(path: str | os.PathLike[str]) -> Path:
    """Where writing `path` lands: a symbolic link is followed, so the rename replaces the file
    it points to and the link stays."""
    target = Path(path)
    return Path(os.path.realpath(target)) if target.is_symlink() else target


def check_folder_of(path: str | os.PathLike[str], what: str) -> None:
    """InputError unless `path` can be written: stdout (`-`), a writable terminal or pipe, or a
    file in a folder that exists and is writable (the temporary file goes there).

    For outputs written at the end of a long run: a typo in the path fails before the run.
    """
    if is_stdout(path):
        return
    if in_place(Path(path)):
        if not os.access(path, os.W_OK):
            raise InputError(f"cannot write {what} to {path}: it is not writable")
        return
    target = landing(path)
    if target.is_dir():
        raise InputError(f"cannot write {what} to {path}: it is a folder; give a file name")
    folder = target.parent
    if not folder.is_dir():
        raise InputError(f"cannot write {what} to {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise InputError(f"cannot write {what} to {path}: folder {folder} is not writable")


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether writing `a` would write `b` (links followed; either may not exist yet)."""
    return os.path.realpath(a) == os.path.realpath(b)


def check_outputs(outputs: dict[str, str | os.PathLike[str] | None], keep: Iterable[str | os.PathLike[str]] = (),
                  *, made_later: str | os.PathLike[str] | None = None) -> None:
    """InputError, before the work, for an output file (`{what: path}`; None: not asked for) that
    cannot be written (`check_folder_of`) or would replace another output or a file in `keep`
    (what the command reads, the run's own files).

    A file in `made_later`, the folder the run makes, is not checked for its folder while that
    folder does not exist: check again once it does.
    """
    to_stdout = [what for what, path in outputs.items() if path is not None and is_stdout(path)]
    if len(to_stdout) > 1:
        raise InputError(f"{' and '.join(to_stdout)} cannot both go to stdout: give one of them a file name")
    given = {what: path for what, path in outputs.items() if path is not None and not is_stdout(path)}
    pending = made_later is not None and not os.path.isdir(made_later)
    for what, path in given.items():
        if not in_place(Path(path)):
            for other in [*keep, *(other for name, other in given.items() if name != what)]:
                if same_file(path, other):
                    alias = "" if os.fspath(other) == os.fspath(path) else f" (that is {other})"
                    raise InputError(f"cannot write {what} to {path}{alias}: this command also reads or writes "
                                     "that file; give another name")
        if not (pending and same_file(landing(path).parent, made_later)):
            check_folder_of(path, what)


def _stage(path: str | os.PathLike[str], text: str, what: str) -> tuple[Path, Path]:
    """Write `text` to a unique temporary file beside `path`'s landing place; (temporary, target).
    A missing or unwritable folder is an InputError, a failure while writing a KvdiffError; no
    temporary file is left on failure."""
    check_folder_of(path, what)
    target = landing(path)
    try:
        fd, temp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise InputError(f"cannot write {what} to {target}: {exc.strerror}") from exc
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(temp, 0o644)
    except OSError as exc:
        Path(temp).unlink(missing_ok=True)
        raise KvdiffError(f"cannot write {what} to {target}: {exc.strerror}") from exc
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return Path(temp), target


def _write_directly(path: str | os.PathLike[str], text: str, what: str) -> None:
    """stdout (`-`, `/dev/stdout`), or a terminal or pipe written in place."""
    if is_stdout(path):
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:
            stdout_gone()
        return
    try:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as exc:
        raise KvdiffError(f"cannot write {what} to {path}: {exc.strerror}") from exc


def write_text_atomically(path: str | os.PathLike[str], text: str, what: str) -> Path:
    """Write `text` to `path` through a unique temporary file in the same folder, then rename.

    `-` and `/dev/stdout` are stdout, other terminals and pipes are written in place; a symbolic
    link's file is replaced, not the link. `what` names the file in errors ("the HTML report").
    A missing or unwritable folder is an InputError; a failure while writing (disk full) is a
    KvdiffError; no temporary file is left.
    """
    written = write_texts_atomically([(path, text, what)])
    return written[0]


def write_texts_atomically(files: list[tuple[str | os.PathLike[str], str, str]]) -> list[Path]:
    """Write several files (path, text, what) all or none: each file goes to its temporary file
    first, and only when every one is complete are they renamed into place, then stdout and
    in-place files written. A failure (disk full) leaves none of them changed and no temporary
    file (`diff --json A --html B` kept A when B did not fit)."""
    directly = [is_stdout(path) or in_place(Path(path)) for path, _, _ in files]
    staged: list[tuple[Path, Path, str]] = []
    try:
        for (path, text, what), direct in zip(files, directly):
            if not direct:
                staged.append((*_stage(path, text, what), what))
        for temp, target, what in staged:
            try:
                os.replace(temp, target)
            except OSError as exc:
                raise KvdiffError(f"cannot write {what} to {target}: {exc.strerror}") from exc
    finally:
        for temp, _, _ in staged:
            temp.unlink(missing_ok=True)
    targets = iter(target for _, target, _ in staged)
    for (path, text, what), direct in zip(files, directly):
        if direct:
            _write_directly(path, text, what)
    return [Path(path) if direct else next(targets) for (path, _, _), direct in zip(files, directly)]

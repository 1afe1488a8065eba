"""Run folders: a new or empty folder per run, claimed by one process at a time, emptied of
partial artefacts when a run fails, and the checks that keep report copies off each other."""

from __future__ import annotations

import itertools
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from kvdiff.errors import InputError
from kvdiff.files import check_outputs, same_file

log = logging.getLogger(__name__)

RUNS_ROOT = Path("kvdiff-runs")
ARTEFACTS = ("reference.h5", "candidate.h5", "report.json", "report.html")
CLAIM = ".kvdiff-writing"      # marks a run folder in use (claimed_out_dir)


def prepare_out_dir(out: Path | str | None, strategy: str) -> Path:
    """A fresh folder for one run: `out` if new or empty, else a new one under ./kvdiff-runs/."""
    if out is not None:
        out = Path(out)
        try:                                # a name too long for the file system fails already in exists()
            if out.exists():
                if not out.is_dir():
                    raise InputError(f"--out {out} exists and is not a folder")
                _refuse_if_holding_files(out)
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"cannot create output folder {out}: {exc.strerror}") from None
        if not os.access(out, os.W_OK):
            raise InputError(f"output folder {out} is not writable")
        return out
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root = Path.cwd() / RUNS_ROOT
    for n in range(1000):
        candidate = root / f"{stamp}-{strategy}" if n == 0 else root / f"{stamp}-{strategy}-{n}"
        try:
            candidate.mkdir(parents=True, exist_ok=False)
            return candidate
        except FileExistsError:
            continue
        except OSError as exc:
            raise InputError(f"cannot create output folder {candidate}: {exc.strerror}") from None
    raise InputError(f"too many runs in {RUNS_ROOT} this second: pass --out DIR")


def _in_use(out: Path) -> InputError:
    return InputError(f"--out {out} is being written by another kvdiff run: wait for it to end or choose another "
                      f"folder (if none runs, one was killed: remove {out / CLAIM})")


def _refuse_if_holding_files(out: Path, ignore: str | None = None) -> None:
    names = [name for name in itertools.islice((entry.name for entry in out.iterdir()), 3) if name != ignore]
    if names == [CLAIM]:
        raise _in_use(out)
    if names:
        raise InputError(f"--out {out} already holds files (an earlier run?): choose a new folder or empty it")


@contextmanager
def claimed_out_dir(out: Path | str | None, label: str) -> Iterator[Path]:
    """The run's folder (`prepare_out_dir`), claimed for the run by a marker file created
    exclusively: another kvdiff process given the same `--out` meanwhile is refused. The marker
    goes when the run ends; after a failure, so does the folder if this call made it and
    nothing is left in it."""
    created = out is None or not Path(out).exists()
    out_dir = prepare_out_dir(out, label)
    claim = out_dir / CLAIM
    try:
        claim.open("x").close()
    except FileExistsError:
        raise _in_use(out_dir) from None
    except OSError as exc:
        raise InputError(f"cannot write in output folder {out_dir}: {exc.strerror}") from None
    try:
        _refuse_if_holding_files(out_dir, ignore=CLAIM)     # a run that ended between the check and the claim
        yield out_dir
    except BaseException:
        claim.unlink(missing_ok=True)
        if created:
            try:
                out_dir.rmdir()
            except OSError:
                log.debug("kept %s: it holds files this run did not write", out_dir)
        raise
    claim.unlink(missing_ok=True)


@contextmanager
def discarded_on_failure(out_dir: Path, artefacts: tuple[str, ...] = ARTEFACTS) -> Iterator[None]:
    """On any failure or interrupt, remove what the run wrote."""
    try:
        yield
    except BaseException:
        for name in artefacts:
            (out_dir / name).unlink(missing_ok=True)
        raise


def check_report_copies(json_path: Path | str | None, html: Path | str | None, out: Path | str | None,
                        artefacts: tuple[str, ...] = ARTEFACTS) -> None:
    """InputError for an extra copy of a report that cannot be written or would replace another
    file of the run (`check_outputs`); a copy onto the run's own report is that report. Checked
    before the run, and again once the run's folder is made."""
    copies = {"report.json": json_path, "the HTML report": html}
    if out is None:
        check_outputs(copies)
        return
    own = {"report.json": "report.json", "the HTML report": "report.html"}
    copies = {what: path for what, path in copies.items() if path is None or not same_file(path, Path(out) / own[what])}
    check_outputs(copies, [Path(out) / name for name in artefacts], made_later=out)

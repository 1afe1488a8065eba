"""`kvdiff compare`: reference and chunked engine, both probed, diffed, reported into one folder."""

from __future__ import annotations

import itertools
import logging
import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from kvdiff.engine.conversation import Messages, validate_messages
from kvdiff.errors import InputError
from kvdiff.files import check_outputs, same_file
from kvdiff.probes.selection import check_ranges, parse_points

log = logging.getLogger(__name__)

STRATEGIES = ("none", "prefix", "isolated-local", "isolated-global", "rerotate", "blend")
NUMERICS = ("exact", "fast")
RUNS_ROOT = Path("kvdiff-runs")
ARTEFACTS = ("reference.h5", "candidate.h5", "report.json", "report.html")
CLAIM = ".kvdiff-writing"      # marks a run folder in use (claimed_out_dir)


@dataclass
class CompareResult:
    """What a compare run produced: the divergence and where its artefacts are."""

    divergence: object  # kvdiff.analysis.Divergence
    report: dict = field(repr=False)    # report.json, megabytes for a real model: not in the repr
    out_dir: Path
    reference_trace: Path
    candidate_trace: Path
    report_json: Path
    report_html: Path

    @property
    def exit_code(self) -> int:
        return 0 if self.divergence.tokens_identical else 1

    @property
    def summary(self) -> str:
        """One line: verdict, first token flip, first divergence, diagnoses."""
        r = self.report
        if r["tokens_identical"]:
            return "tokens identical"
        parts = []
        flip = r.get("first_token_divergence")
        if flip:
            parts.append(f"tokens differ at step {flip['step']} ({flip['reference_token']!r} vs {flip['candidate_token']!r})")
        first = r.get("first_divergence")
        if first:
            parts.append(f"first divergence at layer {first['layer']} position {first['position']} {first['tensor']}")
        kinds = sorted({d["kind"] for d in r.get("diagnoses", [])})
        if kinds:
            parts.append("diagnoses: " + ", ".join(kinds))
        return "; ".join(parts) or "tokens differ"


def check_options(strategy: str, numerics: str, max_new_tokens: int, recompute_ratio: float,
                  chunk_size: int | None, capture: str | None = None, layers: str | None = None) -> None:
    """Reject bad options before any model is loaded (the layers' range is checked against the
    model once it is loaded, their syntax here)."""
    if strategy not in STRATEGIES:
        raise InputError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    if numerics not in NUMERICS:
        raise InputError(f"unknown numerics {numerics!r}: use exact or fast")
    if not 1 <= max_new_tokens <= 100_000:
        raise InputError(f"max_new_tokens must be between 1 and 100000, got {max_new_tokens}")
    if not 0.0 <= recompute_ratio <= 1.0:
        raise InputError(f"recompute_ratio must be in [0, 1], got {recompute_ratio}")
    if chunk_size is not None and chunk_size < 1:
        raise InputError(f"chunk_size must be a positive number of tokens, got {chunk_size}")
    if capture is not None:
        parse_points(capture)
    if isinstance(layers, str):
        check_ranges(layers, "layer")


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
def _discarded_on_failure(out_dir: Path) -> Iterator[None]:
    """On any failure or interrupt, remove what the run wrote."""
    try:
        yield
    except BaseException:
        for name in ARTEFACTS:
            (out_dir / name).unlink(missing_ok=True)
        raise


def check_report_copies(json_path: Path | str | None, html: Path | str | None, out: Path | str | None) -> None:
    """InputError for an extra copy of a report that cannot be written or would replace another
    file of the run (`check_outputs`); a copy onto the run's own report is that report. Checked
    before the run, and again once the run's folder is made."""
    copies = {"report.json": json_path, "the HTML report": html}
    if out is None:
        check_outputs(copies)
        return
    own = {"report.json": "report.json", "the HTML report": "report.html"}
    copies = {what: path for what, path in copies.items() if path is None or not same_file(path, Path(out) / own[what])}
    check_outputs(copies, [Path(out) / name for name in ARTEFACTS], made_later=out)


def compare(
    messages: Messages,
    *,
    model: str = "smollm2-135m",
    strategy: str = "prefix",
    numerics: str = "exact",
    recompute_ratio: float = 0.15,
    chunk_size: int | None = None,
    max_new_tokens: int = 16,
    dtype: str = "float32",
    device: str = "cpu",
    device_map: str | None = None,
    capture: str | None = None,
    layers: str | None = None,
    warm: bool | Messages = False,
    out: Path | str | None = None,
    html: Path | str | None = None,
    json_path: Path | str | None = None,
    model_cache: dict | None = None,
    progress: Callable[[str], None] | None = None,
) -> CompareResult:
    """Run the reference and the chunked engine on `messages`, probe both, diff, and report.

    Writes reference.h5, candidate.h5, report.json and report.html into `out` (default: a new
    folder under ./kvdiff-runs/). `html`/`json_path` write extra copies of the reports. `warm`:
    the engine runs the conversation once, unrecorded, before the recorded run, which then reads
    its chunks from the cache (hits; their positions hold K/V only in the candidate trace); a
    conversation instead of True is run first instead, so only the chunks it shares are hits.
    """
    import kvdiff
    from kvdiff.analysis import diff
    from kvdiff.engine import Engine
    from kvdiff.engine.chunks import split_conversation
    from kvdiff.engine.numerics import exact_numerics
    from kvdiff.probes.recorder import TraceRecorder
    from kvdiff.reports.html import write_html
    from kvdiff.reports.json_report import write_json_atomically

    step = progress or (lambda what: log.info("%s", what))
    messages = validate_messages(messages)
    warm_messages = None if isinstance(warm, bool) else validate_messages(warm)
    check_options(strategy, numerics, max_new_tokens, recompute_ratio, chunk_size, capture, layers)
    check_report_copies(json_path, html, out)
    with claimed_out_dir(out, strategy) as out_dir, _discarded_on_failure(out_dir):
        check_report_copies(json_path, html, out_dir)
        step("loading model")
        key = (model, dtype, device, device_map)
        if model_cache is not None and key in model_cache:
            loaded, tokenizer = model_cache[key]
        else:
            loaded, tokenizer = kvdiff.load_model(model, dtype=dtype, device=device, device_map=device_map)
            if model_cache is not None:
                model_cache[key] = (loaded, tokenizer)

        # The engine drops empty messages (no chunk); the reference must render the same prompt.
        chunked = split_conversation(tokenizer, messages, chunk_size=chunk_size)
        engine = Engine(loaded, tokenizer, strategy=strategy, numerics=numerics,
                        chunk_size=chunk_size, recompute_ratio=recompute_ratio)
        engine.check_fits(chunked, max_new_tokens)
        warm_chunked = chunked if warm_messages is None else split_conversation(tokenizer, warm_messages,
                                                                                chunk_size=chunk_size)
        if warm:
            engine.check_fits(warm_chunked, 1, "warm-up ")
        reference_path = out_dir / "reference.h5"
        candidate_path = out_dir / "candidate.h5"
        numerics_ctx = exact_numerics(loaded) if numerics == "exact" else nullcontext()
        step("recording the reference")
        with numerics_ctx:
            kvdiff.record(loaded, tokenizer, chunked.messages, reference_path, max_new_tokens=max_new_tokens,
                          capture=capture, layers=layers, strategy="reference", numerics=numerics,
                          fingerprint=engine.fingerprint)     # the weights' hash, once per compare

        if warm:
            step("filling the engine's cache (--warm)")
            engine.generate([warm_chunked.messages], max_new_tokens=1)
        step(f"running the engine ({strategy}, {numerics})")
        recorder = TraceRecorder.for_model(loaded, tokenizer, chunked.messages, candidate_path, strategy=strategy,
                                           numerics=numerics, capture=capture, layers=layers,
                                           fingerprint=engine.fingerprint, max_new_tokens=max_new_tokens)
        try:
            (output,) = engine.generate([chunked.messages], max_new_tokens=max_new_tokens, sinks={0: recorder})
        except BaseException:
            recorder.abort()
            raise
        recorder.finish(output.token_ids, output.text, output.chunks)

        step("diffing")
        divergence = diff(reference_path, candidate_path, tokenizer=tokenizer)
        report = divergence.to_json()
        report["skipped_messages"] = [
            {"index": s.message_index, "role": s.role, "reason": s.reason} for s in chunked.skipped
        ]
        report_json = out_dir / "report.json"
        report_html = out_dir / "report.html"
        write_json_atomically(report, report_json)
        write_html(report, report_html)
        if json_path is not None:
            write_json_atomically(report, Path(json_path))
        if html is not None:
            write_html(report, Path(html))
        return CompareResult(divergence, report, out_dir, reference_path, candidate_path, report_json, report_html)

"""`kvdiff compare --engine X`: an engine under test run cold, cold again and warm, each recorded
from its own tensors, diffed against itself and against kvdiff's reference path.

1. cold, twice, the cache dropped before each: the engine's own noise floor (are two cold runs
   bitwise equal? how far apart are their logits?);
2. a request that shares the prompt's prefix fills the engine's cache, then the prompt runs warm:
   the engine's counters must show a hit (a warm run with no hit tested nothing and fails);
3. kvdiff's continuous reference path on the same checkpoint.

report.json is the diff of cold (reference side) against warm (candidate side), with `engine`,
`noise_floor`, `flips` (each first token flip classified from the data) and
`engine_vs_reference` (the reference against the cold run, diagnosed: kvdiff.run.engine_reference)
added. In digest mode (the default) every run records digests, and cold and warm run a second
time with the zoom window in full (kvdiff.run.zoom); the noise floor comes from the digests (its
logits gap is a lower bound).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from kvdiff.analysis import Divergence, diff
from kvdiff.conversation import Messages, render_prompt_ids, validate_messages
from kvdiff.errors import KvdiffError
from kvdiff.options import EngineWeights, TraceMode
from kvdiff.options import engine_options as parse_engine_options
from kvdiff.run.engine_reference import COLD_WINDOW, REFERENCE_FIRST, against_reference
from kvdiff.run.folder import check_report_copies, claimed_out_dir, discarded_on_failure
from kvdiff.run.options import RunOptions
from kvdiff.run.result import CompareResult, write_reports
from kvdiff.run.zoom import (ZOOM_LAYERS, ZOOM_POSITIONS, ZoomWindow, checked_repeat, diagnoses_with,
                             digest_section, zoom_window)
from kvdiff.targets.protocol import Target, TargetRun
from kvdiff.targets.adapter import AdapterEngine
from kvdiff.targets.registry import EngineName, open_target, parse_engine

log = logging.getLogger(__name__)

ARTEFACTS = ("cold.h5", "cold-again.h5", "warm.h5", "reference.h5", COLD_WINDOW, "report.json", "report.html")
FIRST_PASS = ("cold.first.h5", "warm.first.h5")     # digest mode: kept when the zoom runs disagree with them


def compare_engine(messages: Messages, *, engine: str | EngineName | AdapterEngine, model: str = "smollm2-135m",
                   max_new_tokens: int = 16, warm: bool | Messages = True, out: Path | str | None = None,
                   html: Path | str | None = None, json_path: Path | str | None = None,
                   model_cache: dict | None = None, progress: Callable[[str], None] | None = None,
                   trace_mode: str | TraceMode = TraceMode.DIGEST, zoom_layers: int = ZOOM_LAYERS,
                   zoom_positions: int = ZOOM_POSITIONS,
                   weights: str | EngineWeights = EngineWeights.FLOAT32,
                   engine_options: Mapping[str, Any] | Iterable[str] | None = None) -> CompareResult:
    """Run engine `engine` cold, cold again and warm on `messages`, record each, diff, report.

    `warm`: True fills the cache with the conversation itself; a conversation instead fills it
    with that one (a request sharing a prefix). Exit code of the result: 0 when the warm tokens
    equal the cold ones, 1 otherwise. `trace_mode` "digest": every run records digests, then
    cold and warm run again with a zoom window in full (as `kvdiff.compare`), which also holds
    the logits at the first token flip. `weights`: `kvdiff.targets.registry.open_target`'s;
    `engine_options`: the engine's own settings (`kvdiff.options.engine_options`), given to open_target.
    """
    from kvdiff.run.model_cache import ModelKey, cached_model
    from kvdiff.run.record import record

    name, weights = parse_engine(engine), EngineWeights.parse(weights)
    settings = parse_engine_options(engine_options)
    step = progress or (lambda what: log.info("%s", what))
    messages = validate_messages(messages)
    warm_messages = messages if isinstance(warm, bool) else validate_messages(warm)
    options = RunOptions.of(max_new_tokens=max_new_tokens, trace_mode=trace_mode, zoom_layers=zoom_layers,
                            zoom_positions=zoom_positions)
    mode = options.trace_mode.value
    check_report_copies(json_path, html, out, ARTEFACTS)
    written = ARTEFACTS + FIRST_PASS + (REFERENCE_FIRST,)
    with claimed_out_dir(out, getattr(name, "label", str(name))) as out_dir, discarded_on_failure(out_dir, written):
        check_report_copies(json_path, html, out_dir, ARTEFACTS)
        step("loading model")
        loaded, tokenizer = cached_model(model_cache, ModelKey(model))
        ids = render_prompt_ids(tokenizer, messages)
        step(f"starting {name}")
        recorded = _Recorded(loaded, tokenizer, messages, ids, out_dir, options.max_new_tokens, mode)
        target = open_target(name, loaded, tokenizer, weights, settings)

        def record_reference(path: Path, window: dict) -> None:
            step("recording kvdiff's reference path")
            record(loaded, tokenizer, messages, path, max_new_tokens=options.max_new_tokens, capture=target.points,
                   trace_mode=mode, **window)

        def record_cold(path: Path, window: dict) -> None:
            target.reset_cache()
            step(f"running {target.info.name} cold")
            _recorded_run(target, recorded, "cold", path, window)

        try:
            runs = _cold_cold_warm(target, recorded, warm_messages, step)
            record_reference(out_dir / "reference.h5", {})
            step("diffing")
            main = diff(out_dir / "cold.h5", out_dir / "warm.h5", tokenizer=tokenizer)
            window = zoom_window(main, loaded.config.num_hidden_layers, options.zoom_layers, options.zoom_positions) \
                if options.trace_mode is TraceMode.DIGEST else None
            findings = []
            if window is not None:
                main, findings, runs = _zoom(target, recorded, warm_messages, window, main, step)
            against, against_json = against_reference(out_dir, record_reference, record_cold, options,
                                                      loaded.config.num_hidden_layers, tokenizer, step)
        finally:
            target.close()
        recorded_hit = _cached_positions(main.candidate.kv_only_positions.size, runs["warm"].cache_hit_tokens,
                                         target.info.name)
        noise = diff(out_dir / "cold.h5", out_dir / "cold-again.h5", tokenizer=tokenizer)
        floor = noise_floor(noise)
        extra = {} if options.trace_mode is TraceMode.FULL else {
            "trace_mode": mode, "digest": digest_section(window, findings, {}, main.comparison.alignment.positions)}
        report = main.report(
            **extra,
            engine={"name": target.info.name, "version": target.info.version,
                    "checkpoint": str(target.info.checkpoint), "weights": str(weights), "options": settings,
                    "quantized": target.info.quantized,
                    "cache_hit_tokens": runs["warm"].cache_hit_tokens, "cached_positions_recorded": recorded_hit,
                    "prompt_tokens": len(ids)},
            noise_floor=floor, flips=[flip for flip in [classify_flip(main, floor)] if flip is not None],
            engine_vs_reference={**against_json, "flip": classify_flip(against, floor)})
        report_json, report_html = write_reports(report, out_dir, json_path, html)
        return CompareResult(main, report, out_dir, out_dir / "cold.h5", out_dir / "warm.h5", report_json,
                             report_html)


@dataclass(frozen=True)
class _Recorded:
    """What every recorded run of one engine compare shares."""

    model: object
    tokenizer: object
    messages: Messages
    ids: list[int]
    out_dir: Path
    max_new_tokens: int
    trace_mode: str


def _zoom(target: Target, recorded: _Recorded, warm_messages: Messages, window: ZoomWindow, first: Divergence,
          step: Callable[[str], None]) -> tuple[Divergence, list, dict[str, TargetRun]]:
    """Cold and warm again, with the window (and the logits at the first flip) in full; the
    divergence of those runs, the runs that did not repeat themselves, and the runs."""
    out_dir = recorded.out_dir
    for name, kept in zip(("cold.h5", "warm.h5"), FIRST_PASS):
        (out_dir / name).replace(out_dir / kept)
    flip = first.first_token_divergence
    args = window.recorder_args(None if flip is None else flip.position)
    step(f"zooming in: {window.described} in full")
    runs = _cold_cold_warm(target, recorded, warm_messages, step, ("cold", "warm"), args)
    findings = checked_repeat(tuple(out_dir / name for name in FIRST_PASS),
                              (out_dir / "cold.h5", out_dir / "warm.h5"), ("cold run", "warm run"))
    main = diff(out_dir / "cold.h5", out_dir / "warm.h5", tokenizer=recorded.tokenizer)
    diagnoses_with(main, findings)
    return main, findings, runs


def _cold_cold_warm(target: Target, recorded: _Recorded, warm_messages: Messages, step: Callable[[str], None],
                    labels: tuple[str, ...] = ("cold", "cold again", "warm"),
                    window: dict | None = None) -> dict[str, TargetRun]:
    """The recorded runs (of `labels`); a warm run the engine's counters show no hit for is an
    error. `window`: a digest trace's zoom window (TraceRecorder.for_model's arguments)."""
    files = {"cold": "cold.h5", "cold again": "cold-again.h5", "warm": "warm.h5"}
    runs: dict[str, TargetRun] = {}
    for label in labels:
        target.reset_cache()        # before the fill too: the warm run may hit only what the fill left
        if label == "warm":
            step(f"filling {target.info.name}'s cache")
            # a whole request: transformers' continuous batching keeps no blocks of one that ends in its prefill
            target.generate(render_prompt_ids(recorded.tokenizer, warm_messages), recorded.max_new_tokens)
        step(f"running {target.info.name} {label}")
        runs[label] = _recorded_run(target, recorded, label, recorded.out_dir / files[label], window or {})
    if runs["warm"].cache_hit_tokens == 0:
        advice = target.info.no_reuse or "give a longer shared prefix (engines cache whole blocks only)"
        raise KvdiffError(f"the warm run of {target.info.name} had no cache hit (its counters show 0 cached tokens), "
                          f"so it tested nothing: {advice}")
    return runs


def _recorded_run(target: Target, recorded: _Recorded, label: str, path: Path, window: dict) -> TargetRun:
    """One request on the engine recorded into `path`; a cold run the engine served from its cache
    is an error (its reset does not work)."""
    from kvdiff.probes.recorder import TraceRecorder

    recorder = TraceRecorder.for_model(recorded.model, recorded.tokenizer, recorded.messages, path,
                                       input_ids=recorded.ids, strategy=f"{target.info.name} {label}",
                                       numerics="engine", capture=target.points,
                                       max_new_tokens=recorded.max_new_tokens, trace_mode=recorded.trace_mode,
                                       **window)
    try:
        run = target.generate(recorded.ids, recorded.max_new_tokens, sink=recorder)
    except BaseException:
        recorder.abort()
        raise
    recorder.finish(run.token_ids, run.text)
    if label.startswith("cold") and run.cache_hit_tokens:
        raise KvdiffError(f"{target.info.name} served {run.cache_hit_tokens} tokens from its cache on a cold run "
                          "after its cache was dropped: its reset does not work, so cold and warm cannot be told apart")
    return run


def _cached_positions(recorded: int, counted: int, engine: str) -> int:
    """How many positions the warm trace records as read from the cache (`recorded`); a count other
    than the engine's own (`counted`) is said: the adapter's count or its recording is wrong."""
    recorded = int(recorded)
    if recorded != counted:
        log.warning("%s counted %d prompt tokens from its cache, but the warm trace records %d positions read from "
                    "it: the engine's count or its adapter's recording is wrong", engine, counted, recorded)
    return recorded


def noise_floor(noise: Divergence) -> dict:
    """What two cold runs of one engine differ by: their tokens, their bits, their logits."""
    logits = noise.comparison.final.get("logits")
    worst = float(np.nanmax(logits.max_abs)) if logits is not None and np.isfinite(logits.max_abs).any() else None
    return {"tokens_identical": noise.tokens_identical, "bitwise_equal": noise.first_bit_difference is None,
            "max_abs_logit": worst}


def classify_flip(div: Divergence, floor: dict) -> dict | None:
    """The first token flip of `div`, classified from the tensors.

    `near_tie`: no row before the flip's logits breaks tolerance, and the logits at that row
    differ by enough to swap the top two (a margin at most twice the largest logit difference,
    or within the cold runs' own noise). `divergence` otherwise, with where it starts.
    """
    td = div.first_token_divergence
    if td is None:
        return None
    logits = div.comparison.final.get("logits")
    at = None
    if logits is not None:
        hit = np.flatnonzero(logits.positions == td.position)
        at = float(logits.max_abs[0, hit[0]]) if hit.size and np.isfinite(logits.max_abs[0, hit[0]]) else None
    first = div.first_divergence
    upstream_clean = first is None or (first.position >= td.position and first.tensor in ("logits", "final_norm"))
    margin = td.reference_margin
    swing = max(2 * at if at is not None else 0.0, floor.get("max_abs_logit") or 0.0)
    near = upstream_clean and margin is not None and math.isfinite(margin) and margin <= swing
    return {"step": td.step, "position": td.position, "kind": "near_tie" if near else "divergence",
            "reference_token": td.reference_token, "candidate_token": td.candidate_token,
            "reference_margin": _finite(td.reference_margin), "candidate_margin": _finite(td.candidate_margin),
            "logit_max_abs": at, "first_divergence": _where(div),
            "diagnoses": sorted({d.kind for d in div.diagnoses})}


def _where(div: Divergence) -> dict | None:
    return None if div.first_divergence is None else div.first_divergence.to_json()


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None

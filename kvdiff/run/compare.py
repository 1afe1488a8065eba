"""`kvdiff compare`: reference and chunked engine, both probed, diffed, reported into one folder."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from kvdiff.analysis import Divergence, diff
from kvdiff.analysis.report import Report
from kvdiff.conversation import Messages, validate_messages
from kvdiff.errors import InputError
from kvdiff.options import DEFAULT_RECOMPUTE_RATIO, EngineWeights, Numerics, Strategy, TraceMode
from kvdiff.options import engine_options as parse_engine_options
from kvdiff.run.folder import ARTEFACTS, check_report_copies, claimed_out_dir, discarded_on_failure
from kvdiff.run.options import RunOptions
from kvdiff.run.result import CompareResult, write_reports
from kvdiff.run.zoom import (FIRST_PASS, ZOOM_LAYERS, ZOOM_POSITIONS, checked_repeat, diagnoses_with,
                             digest_section, zoom_window)

log = logging.getLogger(__name__)


def compare(
    messages: Messages,
    *,
    model: str = "smollm2-135m",
    strategy: str | Strategy = Strategy.PREFIX,
    numerics: str | Numerics = Numerics.EXACT,
    recompute_ratio: float = DEFAULT_RECOMPUTE_RATIO,
    chunk_size: int | None = None,
    max_new_tokens: int = 16,
    dtype: str = "float32",
    device: str = "cpu",
    device_map: str | None = None,
    gpu_memory: str | None = None,
    capture: str | None = None,
    layers: str | None = None,
    warm: bool | Messages = False,
    out: Path | str | None = None,
    html: Path | str | None = None,
    json_path: Path | str | None = None,
    model_cache: dict | None = None,
    progress: Callable[[str], None] | None = None,
    engine: str = "kvdiff",
    engine_weights: str | EngineWeights = EngineWeights.FLOAT32,
    engine_options: Mapping[str, Any] | Iterable[str] | None = None,
    trace_mode: str | TraceMode = TraceMode.DIGEST,
    zoom_layers: int = ZOOM_LAYERS,
    zoom_positions: int = ZOOM_POSITIONS,
) -> CompareResult:
    """Run the reference and the chunked engine on `messages`, probe both, diff, and report.

    Writes reference.h5, candidate.h5, report.json and report.html into `out` (default: a new
    folder under ./kvdiff-runs/). `html`/`json_path` write extra copies of the reports. `warm`:
    the engine runs the conversation once, unrecorded, before the recorded run, which then reads
    its chunks from the cache (hits; their positions hold K/V only in the candidate trace); a
    conversation instead of True is run first instead, so only the chunks it shares are hits.

    `trace_mode`: "digest" (the default) records a hash and statistics of every row in a first
    pass, then runs both sides again recording full rows only in a window of `zoom_layers` x
    `zoom_positions` around the first difference (`kvdiff.run.zoom`); the traces are the zoom
    run's. "full" records every row once (`capture` and `layers` select what).

    `model_cache`: models kept across calls, by `kvdiff.run.model_cache.ModelKey`.

    `engine`: "kvdiff" (its own chunked engine, as above), or an engine under test
    ("transformers", "vllm", "llama.cpp", or the user's adapter: "FILE.py:FACTORY", "MODULE:FACTORY"
    or the factory, `kvdiff.targets.adapter`), which runs cold, cold again and warm instead
    (`kvdiff.run.engine_compare`); strategy, numerics, chunking and capture options are kvdiff's
    engine's and are refused with another engine. `engine_weights` (an engine under test only):
    "float32" runs it on the reference's own values (llama.cpp on a float32 copy of the GGUF, so
    that every rule can set its tensors against the reference's), "native" on the checkpoint as
    it is (a quantized GGUF runs quantized). `engine_options` (an engine under test only): its own
    settings over kvdiff's, a mapping or `KEY=VALUE` strings (`kvdiff.options.engine_options`):
    vllm.LLM's arguments (`hf_overrides`, `max_model_len`), llama_cpp.Llama's (`flash_attn`,
    `rope_freq_base`), or transformers' ContinuousBatchingConfig's fields (`page_size`).
    """
    from kvdiff.engine import Engine
    from kvdiff.engine.chunks import split_conversation
    from kvdiff.probes.recorder import TraceRecorder
    from kvdiff.run.blend_errors import blend_errors_section
    from kvdiff.run.model_cache import ModelKey, cached_model
    from kvdiff.run.record import record
    from kvdiff.trace.fingerprint import model_fingerprint

    if engine != "kvdiff":
        return _compare_other_engine(messages, engine, model, max_new_tokens, warm, out, html, json_path,
                                     model_cache, progress, engine_weights, engine_options, strategy=strategy,
                                     numerics=numerics,
                                     recompute_ratio=recompute_ratio, chunk_size=chunk_size, dtype=dtype,
                                     device=device, device_map=device_map, gpu_memory=gpu_memory, capture=capture,
                                     layers=layers, trace_mode=trace_mode, zoom_layers=zoom_layers,
                                     zoom_positions=zoom_positions)
    if EngineWeights.parse(engine_weights) is not EngineWeights.FLOAT32:
        raise InputError("--engine-weights applies to an engine under test (--engine transformers, vllm or "
                         "llama.cpp): kvdiff's engine runs the reference's weights")
    if parse_engine_options(engine_options):
        raise InputError("--engine-option applies to an engine under test (--engine transformers, vllm or "
                         "llama.cpp): kvdiff's engine takes --strategy, --numerics and its other options")
    step = progress or (lambda what: log.info("%s", what))
    messages = validate_messages(messages)
    warm_messages = None if isinstance(warm, bool) else validate_messages(warm)
    options = RunOptions.of(strategy, numerics, max_new_tokens, recompute_ratio, chunk_size, capture, layers,
                            trace_mode, zoom_layers, zoom_positions)
    strategy, numerics, capture = options.strategy, options.numerics, options.capture
    check_report_copies(json_path, html, out)
    with claimed_out_dir(out, str(strategy)) as out_dir, discarded_on_failure(out_dir, ARTEFACTS + FIRST_PASS):
        check_report_copies(json_path, html, out_dir)
        step("loading model")
        loaded, tokenizer = cached_model(model_cache, ModelKey(model, dtype, device, device_map, gpu_memory))
        fingerprint = model_fingerprint(loaded)     # once a run: every engine of it (zoom, blend's) shares it

        # The engine drops empty messages (no chunk); the reference must render the same prompt.
        chunked = split_conversation(tokenizer, messages, chunk_size=chunk_size)
        warm_chunked = chunked if warm_messages is None else split_conversation(tokenizer, warm_messages,
                                                                                chunk_size=chunk_size)

        def run_both(reference_path: Path, candidate_path: Path, mode: TraceMode, window: dict) -> None:
            """Record the reference, then a fresh engine (warmed up first if asked) as the candidate;
            `window`: the rows kept in full (`layers`, `positions`, `key_positions`)."""
            engine = Engine(loaded, tokenizer, strategy=strategy, numerics=numerics, chunk_size=chunk_size,
                            recompute_ratio=options.recompute_ratio, fingerprint=fingerprint)
            engine.check_fits(chunked, max_new_tokens)
            if warm:
                engine.check_fits(warm_chunked, 1, "warm-up ")
            step("recording the reference")
            record(loaded, tokenizer, chunked.messages, reference_path, max_new_tokens=max_new_tokens,
                   capture=capture, strategy="reference", numerics=str(numerics), fingerprint=fingerprint,
                   trace_mode=mode, **window)
            if warm:
                step("filling the engine's cache (--warm)")
                engine.generate([warm_chunked.messages], max_new_tokens=1)
            step(f"running the engine ({strategy}, {numerics})")
            recorder = TraceRecorder.for_model(loaded, tokenizer, chunked.messages, candidate_path,
                                               strategy=str(strategy), numerics=str(numerics), capture=capture,
                                               fingerprint=fingerprint, max_new_tokens=max_new_tokens,
                                               trace_mode=mode.value, **window)
            try:
                (output,) = engine.generate([chunked.messages], max_new_tokens=max_new_tokens, sinks={0: recorder})
            except BaseException:
                recorder.abort()
                raise
            recorder.finish(output.token_ids, output.text, output.chunks)

        reference_path = out_dir / "reference.h5"
        candidate_path = out_dir / "candidate.h5"
        skipped = {"skipped_messages": [{"index": s.message_index, "role": s.role, "reason": s.reason}
                                        for s in chunked.skipped]}
        skipped.update(blend_errors_section(loaded, tokenizer, chunked.messages, options, step, fingerprint))
        if options.trace_mode is TraceMode.FULL:
            run_both(reference_path, candidate_path, TraceMode.FULL, {"layers": options.layers})
            step("diffing")
            divergence = diff(reference_path, candidate_path, tokenizer=tokenizer)
            report = divergence.report(**skipped)
        else:
            divergence, report = _digest_then_zoom(run_both, out_dir, options, loaded.config.num_hidden_layers,
                                                   tokenizer, step, skipped)
        report_json, report_html = write_reports(report, out_dir, json_path, html)
        return CompareResult(divergence, report, out_dir, reference_path, candidate_path, report_json, report_html)


def _digest_then_zoom(run_both: Callable, out_dir: Path, options: RunOptions, num_layers: int, tokenizer,
                      step: Callable[[str], None], extra: dict) -> tuple[Divergence, Report]:
    """Digest capture: a first pass of digests, then a zoom run of both sides with the window
    around the first difference in full; reference.h5 and candidate.h5 are the zoom run's (the
    first pass's when nothing differs; kept beside them as *.first.h5 when the runs disagree)."""
    first = out_dir / FIRST_PASS[0], out_dir / FIRST_PASS[1]
    final = out_dir / "reference.h5", out_dir / "candidate.h5"
    run_both(*first, TraceMode.DIGEST, {})
    step("diffing the digests")
    divergence = diff(*first, tokenizer=tokenizer)
    sizes = {"first_pass": sum(p.stat().st_size for p in first)}
    window = zoom_window(divergence, num_layers, options.zoom_layers, options.zoom_positions)
    findings = []
    if window is None:
        for path, target in zip(first, final):
            path.replace(target)
    else:
        step(f"zooming in: {window.described} in full")
        run_both(*final, TraceMode.DIGEST, window.row_args())
        sizes["zoom"] = sum(p.stat().st_size for p in final)
        findings = checked_repeat(first, final)
        step("diffing")
        divergence = diff(*final, tokenizer=tokenizer)
        diagnoses_with(divergence, findings)
    positions = divergence.comparison.alignment.positions
    return divergence, divergence.report(**extra, trace_mode="digest",
                                         digest=digest_section(window, findings, sizes, positions))


def _compare_other_engine(messages, engine, model, max_new_tokens, warm, out, html, json_path, model_cache,
                          progress, engine_weights, engine_options, **kvdiff_only) -> CompareResult:
    """An engine under test: refuse the options only kvdiff's engine has, then run cold/cold/warm."""
    from kvdiff.run.engine_compare import compare_engine
    from kvdiff.targets.registry import parse_engine

    name = parse_engine(engine)
    defaults = {"strategy": Strategy.PREFIX, "numerics": Numerics.EXACT, "recompute_ratio": DEFAULT_RECOMPUTE_RATIO,
                "chunk_size": None, "dtype": "float32", "device": "cpu", "device_map": None, "gpu_memory": None,
                "capture": None, "layers": None}
    digest = {k: kvdiff_only.pop(k) for k in ("trace_mode", "zoom_layers", "zoom_positions")}
    given = [k for k, v in kvdiff_only.items() if v != defaults[k]]
    if given:
        raise InputError(f"{', '.join(given)} apply to kvdiff's own engine, not to --engine {name}: leave them out")
    return compare_engine(messages, engine=name, model=model, max_new_tokens=max_new_tokens,
                          warm=True if warm is False else warm, out=out, html=html, json_path=json_path,
                          model_cache=model_cache, progress=progress, weights=engine_weights,
                          engine_options=engine_options, **digest)

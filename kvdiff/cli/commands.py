"""The commands that run and read comparisons: generate, compare, diff, report, inspect."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer

from kvdiff.cli.options import (
    DEFAULT_NUMERICS, DEFAULT_RATIO, DEFAULT_STRATEGY, DEFAULT_TRACE_MODE, Device, DeviceMap, DType,
    GpuMemory, MessagesFile, Model, NumericsOption, Point, Prompt, RecomputeRatio, StrategyOption, System,
    TraceModeOption, ZoomLayers, ZoomPositions,
)
from kvdiff.cli.app import app, check_point, command, console, echo, for_humans, progress, show_report
from kvdiff.errors import InputError
from kvdiff.options import DEFAULT_MODEL, EngineWeights, engine_options, model_path
from kvdiff.files import check_outputs

log = logging.getLogger("kvdiff")


@app.command()
@command
def generate(
    prompt: Prompt = None,
    system: System = None,
    messages: MessagesFile = None,
    model: Model = DEFAULT_MODEL,
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", "-n", min=1, help="Tokens to generate."),
    dtype: DType = "float32",
    device: Device = "cpu",
    device_map: DeviceMap = None,
    gpu_memory: GpuMemory = None,
) -> None:
    """Generate greedily on the reference (continuous) path and print the answer.

    Example: kvdiff generate --system "You are a helpful assistant." --prompt "What is the capital of France?"
    """
    from kvdiff.conversation import build_messages

    conversation = build_messages(prompt, system, messages)
    model_path(model)       # before torch loads (seconds), for a quick error
    from kvdiff.engine.loading import load_model
    from kvdiff.engine.reference import reference_generate
    from kvdiff.reports.printable import printable

    loaded_model, tokenizer = load_model(model, dtype=dtype, device=device, device_map=device_map,
                                         gpu_memory=gpu_memory)
    out = reference_generate(loaded_model, tokenizer, conversation, max_new_tokens)
    echo(printable(out.text))        # a model may generate control characters: shown as escapes


@app.command()
@command
def compare(
    prompt: Prompt = None,
    system: System = None,
    messages: MessagesFile = None,
    model: Model = DEFAULT_MODEL,
    strategy: StrategyOption = DEFAULT_STRATEGY,
    numerics: NumericsOption = DEFAULT_NUMERICS,
    recompute_ratio: RecomputeRatio = DEFAULT_RATIO,
    chunk_size: Optional[int] = typer.Option(None, "--chunk-size", help="Cut the prompt into fixed N-token chunks."),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", "-n", help="Tokens to generate."),
    dtype: DType = "float32",
    device: Device = "cpu",
    device_map: DeviceMap = None,
    gpu_memory: GpuMemory = None,
    capture: Optional[str] = typer.Option(None, "--capture", help="Probe points to record, comma-separated (default all)."),
    layers: Optional[str] = typer.Option(None, "--layers", help="--trace-mode full: layers to record, e.g. "
                                         "0-3,29 (default all)."),
    trace_mode: TraceModeOption = DEFAULT_TRACE_MODE,
    zoom_layers: ZoomLayers = 2,
    zoom_positions: ZoomPositions = 64,
    warm: bool = typer.Option(False, "--warm", help="Run the conversation through the engine once first, so the "
                              "compared run reads its chunks from the cache."),
    warm_with: Optional[Path] = typer.Option(None, "--warm-with", help="A JSON file of messages the engine runs "
                                             "first instead (implies --warm): only the chunks they share are hits."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output folder (new or empty); default ./kvdiff-runs/<time>-<strategy>."),
    html: Optional[Path] = typer.Option(None, "--html", help="Also write the HTML report here."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write report.json here."),
    point: Point = None,
    engine: str = typer.Option("kvdiff", "--engine", help="kvdiff (its own chunked engine), or an engine under "
                               "test run cold, cold again and warm: transformers, vllm, llama.cpp, or your own "
                               "adapter as FILE.py:FACTORY or MODULE:FACTORY (docs/engines.md)."),
    engine_weights: str = typer.Option("float32", "--engine-weights", help="An engine under test runs float32: the "
                                       "reference's weights (llama.cpp a float32 copy of the GGUF, made once), so "
                                       "its tensors can be set against the reference's; or native: the checkpoint "
                                       "as it is (a quantized GGUF runs quantized)."),
    engine_option: Optional[list[str]] = typer.Option(None, "--engine-option", help="KEY=VALUE, repeatable: a setting "
                                                      "of the engine under test over kvdiff's (VALUE JSON or text): "
                                                      "vllm.LLM's arguments (max_model_len=4096, hf_overrides={...}), "
                                                      "llama_cpp.Llama's (flash_attn=true), transformers' "
                                                      "ContinuousBatchingConfig's (block_size=32)."),
) -> None:
    """Run the reference and the chunked engine with probes, and report where they part.

    Exit 0 when the tokens are identical, 1 when they differ.

    Example: kvdiff compare --system "You are a helpful assistant. Always answer in French." --prompt "What is the capital of France?" --strategy isolated-local
    """
    from kvdiff.conversation import build_messages
    from kvdiff.run.options import RunOptions

    check_point(point)
    conversation = build_messages(prompt, system, messages)
    warm_up = build_messages(None, None, warm_with) if warm_with is not None else warm
    model_path(model)
    EngineWeights.parse(engine_weights)
    engine_options(engine_option)
    if engine == "kvdiff":      # checked again by the run; here before torch loads (seconds), for a quick error
        RunOptions.of(strategy, numerics, max_new_tokens, recompute_ratio, chunk_size, capture, layers, trace_mode,
                      zoom_layers, zoom_positions)
    from kvdiff.run.compare import compare as run_compare

    with progress() as step:
        result = run_compare(
            conversation, model=model, strategy=strategy, numerics=numerics, recompute_ratio=recompute_ratio,
            chunk_size=chunk_size, max_new_tokens=max_new_tokens, dtype=dtype, device=device, device_map=device_map,
            gpu_memory=gpu_memory, capture=capture, layers=layers, warm=warm_up, out=out, html=html, json_path=json_out,
            progress=step, engine=engine, engine_weights=engine_weights, engine_options=engine_option,
            trace_mode=trace_mode,
            zoom_layers=zoom_layers, zoom_positions=zoom_positions,
        )
    log.info("artefacts in %s", result.out_dir)
    if for_humans(html, json_out):
        show_report(result.report, point)
        echo(f"report: {result.report_html}")
    raise typer.Exit(result.exit_code)


@app.command()
@command
def diff(
    reference: Path = typer.Argument(..., help="The reference trace (.h5)."),
    candidate: Path = typer.Argument(..., help="The candidate trace (.h5)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write report.json (schema 1) to this file."),
    html: Optional[Path] = typer.Option(None, "--html", help="Write the HTML report to this file."),
    tolerance: list[str] = typer.Option([], "--tolerance", help="POINT=ATOL[,RTOL], repeatable."),
    baseline: Optional[Path] = typer.Option(None, "--baseline", help="Engine trace with strategy none, for attribution."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Model whose tokenizer shows token text "
                                        "(default: the model the traces name, when its files are here; else ids)."),
    point: Point = None,
) -> None:
    """Diff two trace files: exit 0 if the tokens are identical, 1 if they differ.

    Works on traces from any engine that writes the trace format (docs/trace-format.md).

    Example: kvdiff diff run/reference.h5 run/candidate.h5 --json report.json --tolerance logits=1e-4,1e-3
    """
    from kvdiff.trace.paths import check_trace_path

    check_point(point)
    traces = [trace for trace in (reference, candidate, baseline) if trace is not None]
    check_outputs({"report.json": json_out, "the HTML report": html}, traces)
    for trace in traces:        # before torch loads (seconds), for a quick error
        check_trace_path(trace)
    if model:
        model_path(model)
    from kvdiff.analysis import diff as run_diff, parse_tolerance
    from kvdiff.engine.loading import load_model
    from kvdiff.files import write_texts_atomically
    from kvdiff.reports.json_report import report_json_text
    from kvdiff.reports.html import render_html
    from kvdiff.reports.printable import printable

    tolerances = dict(parse_tolerance(spec) for spec in tolerance)
    tokenizer = load_model(model)[1] if model else _named_tokenizer(reference)
    div = run_diff(reference, candidate, baseline=baseline, tolerances=tolerances, tokenizer=tokenizer)
    report = div.report()
    # both reports or neither: a disk that fills while the second is written keeps the first out too
    write_texts_atomically([(path, render(), what) for path, render, what in (
        (json_out, lambda: report_json_text(report.to_json()), "report.json"),
        (html, lambda: render_html(report), "the HTML report")) if path is not None])
    if for_humans(html, json_out):
        show_report(report, point)
        attribution = report.section("attribution")
        if attribution:
            echo(printable(f"attribution: {attribution['source']}: {attribution['evidence']}", keep=""))
    raise typer.Exit(0 if div.tokens_identical else 1)


@app.command()
@command
def report(
    run_dir: Path = typer.Argument(..., help="A compare run folder holding report.json."),
    point: Point = None,
) -> None:
    """Re-render the terminal and HTML reports of a compare run folder from its report.json.

    Example: kvdiff report kvdiff-runs/20261121-120000-isolated-local
    """
    import json

    from kvdiff.analysis.report import Report
    from kvdiff.reports.html import write_html

    check_point(point)
    if run_dir.exists() and not run_dir.is_dir():
        raise InputError(f"{run_dir} is not a folder: give the run folder that holds report.json "
                         f"(`kvdiff report {run_dir.parent}`)")
    path = run_dir / "report.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{run_dir} holds no report.json: give a folder written by `kvdiff compare`") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path} is not a kvdiff report ({exc})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path} is not a kvdiff report")
    report = Report.from_json(data)
    if for_humans():
        show_report(report, point)
    write_html(report, run_dir / "report.html")
    raise typer.Exit(0 if report.tokens_identical else 1)


@app.command()
@command
def inspect(
    trace: Path = typer.Argument(..., help="A trace file (.h5) written by kvdiff."),
) -> None:
    """Print what a trace file holds: model, chunks, tokens, probe points, layers and sizes.

    Example: kvdiff inspect run/reference.h5
    """
    from kvdiff.trace.paths import check_trace_path

    check_trace_path(trace)     # before torch loads (seconds), for a quick error
    from kvdiff.reports.inspect import describe_trace
    from kvdiff.trace import open_trace

    with open_trace(trace) as tr:
        console().print(describe_trace(tr))


def _named_tokenizer(trace: Path):
    """The tokenizer of the model the trace names, when local files give it and it is the one
    the trace was recorded with (same tokenizer fingerprint); else None and ids are shown. A
    trace cannot make kvdiff show text from other files than the tokenizer it was made with."""
    from kvdiff.engine.loading import load_tokenizer
    from kvdiff.trace import open_trace
    from kvdiff.trace.fingerprint import tokenizer_fingerprint

    with open_trace(trace) as reader:
        name, fingerprint = reader.meta.model_name, reader.meta.tokenizer_fingerprint
    tokenizer = load_tokenizer(name)
    if tokenizer is not None and tokenizer_fingerprint(tokenizer) != fingerprint:
        log.info("the tokenizer of %r is not the one the trace was recorded with: token ids shown", name)
        return None
    return tokenizer

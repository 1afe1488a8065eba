"""Options several commands share, declared once (typer reads them from `Annotated`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from kvdiff.options import DEFAULT_RECOMPUTE_RATIO, Numerics, Strategy, TraceMode

Prompt = Annotated[Optional[str], typer.Option("--prompt", "-p", help="The user message.")]
System = Annotated[Optional[str], typer.Option("--system", "-s", help="An optional system message.")]
MessagesFile = Annotated[Optional[Path], typer.Option("--messages", help="A JSON file of {role, content} messages.")]
Model = Annotated[str, typer.Option("--model", "-m", help="Model name, folder or .gguf file.")]
DType = Annotated[str, typer.Option("--dtype", help="float32, bfloat16 or float16.")]
Device = Annotated[str, typer.Option("--device", help="cpu, cuda, cuda:N or auto.")]
DeviceMap = Annotated[Optional[str], typer.Option(
    "--device-map", help="Split the model across the visible GPUs (auto, balanced, sequential); replaces --device.")]
GpuMemory = Annotated[Optional[str], typer.Option(
    "--gpu-memory", help="With --device-map: the most weights each GPU holds, e.g. 20GiB (default: what is free).")]
StrategyOption = Annotated[str, typer.Option("--strategy", help=f"Chunk strategy: {Strategy.names()}.")]
NumericsOption = Annotated[str, typer.Option(
    "--numerics", help="exact (batch-invariant, bitwise reproducible) or fast (cascade attention).")]
RecomputeRatio = Annotated[float, typer.Option(
    "--recompute-ratio", help="blend: share of each reused chunk's tokens recomputed with full context.")]
Point = Annotated[Optional[str], typer.Option("--point", help="Probe point of the terminal heatmap.")]
TraceModeOption = Annotated[str, typer.Option(
    "--trace-mode", help="digest (a hash of every row, then full rows around the first difference) or full.")]
ZoomLayers = Annotated[int, typer.Option("--zoom-layers", help="digest: layers recorded in full from the first "
                                         "that differs.")]
ZoomPositions = Annotated[int, typer.Option("--zoom-positions", help="digest: positions recorded in full from the "
                                            "first that differs (from 0 when it is early).")]

DEFAULT_STRATEGY = Strategy.PREFIX.value
DEFAULT_NUMERICS = Numerics.EXACT.value
DEFAULT_RATIO = DEFAULT_RECOMPUTE_RATIO
DEFAULT_TRACE_MODE = TraceMode.DIGEST.value

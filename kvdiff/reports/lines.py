"""One-line texts of report sections, as the terminal report prints them (from report.json values,
which are checked here, not trusted)."""

from __future__ import annotations

import json
from typing import Any


def fmt(value: Any) -> str:
    """A value as the reports print it: floats to 3 significant digits, a pair as a range."""
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return f"{value[0]}–{value[1]}"
    return str(value)


def recomputed_line(recomputed: dict[str, Any]) -> str:
    """blend: which placed positions it computed again, and what its ratio counted."""
    positions = recomputed.get("positions") if isinstance(recomputed.get("positions"), list) else []
    ranges = ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in _runs([int(p) for p in positions]))
    return (f"blend recomputed {len(positions)} of {recomputed.get('placed')} placed positions "
            f"({fmt(recomputed.get('share'))}): {ranges or 'none'}; the ratio counts "
            f"{recomputed.get('counted_over', '?')}")


def digest_line(digest: dict[str, Any]) -> str:
    """What a digest run recorded: every row hashed, the zoom window in full, and whether the zoom
    run repeated the first."""
    zoom = digest.get("zoom") if isinstance(digest.get("zoom"), dict) else None
    window = "no zoom run: every digest equal" if zoom is None else (
        f"layers {_span(zoom.get('layers'))}, positions {_span(zoom.get('positions'))} recorded in full")
    repeated = "" if zoom is None else ("; the zoom run repeated the first" if digest.get("repeated") is True
                                        else "; the zoom run did NOT repeat the first (nondeterministic)")
    return f"digest capture: every row hashed; {window}{repeated}"


def engine_line(engine: dict[str, Any]) -> str:
    """The engine under test, its version, the weights it ran (`--engine-weights`) and the settings
    it was given (`--engine-option`)."""
    weights, quantized, options = engine.get("weights"), engine.get("quantized"), engine.get("options")
    ran = "" if not weights else f" on {weights} weights" + (f" ({quantized})" if quantized else "")
    given = ", ".join(f"{k}={json.dumps(v)}" for k, v in options.items()) if isinstance(options, dict) else ""
    return f"{engine.get('name')} {engine.get('version')}{ran}" + (f", with {given}" if given else "")


def hit_disagreement(engine: dict[str, Any]) -> str:
    """Where the warm trace records another number of cached positions than the engine counted."""
    recorded, counted = engine.get("cached_positions_recorded"), engine.get("cache_hit_tokens")
    if recorded is None or recorded == counted:
        return ""
    return f"; but the warm trace records {recorded} positions read from it: the count or the recording is wrong"


def quantized_note(engine: dict[str, Any]) -> str:
    """What an engine with quantized weights means for its comparison with the reference."""
    quantized = engine.get("quantized")
    if not quantized:
        return ""
    return (f"\n(its matmuls run on {quantized} weights: its projections differ from the reference's by "
            "quantization; what a run's own tensors prove, norms recomputed and RoPE's rotation, is unaffected)")


def _span(value: Any) -> str:
    return f"{value[0]}-{value[1]}" if isinstance(value, list) and len(value) == 2 else "?"


def _runs(values: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    return runs

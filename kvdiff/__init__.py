"""kvdiff: differential testing and KV-divergence debugging for chunked LLM generation."""

import os

# Never reach a model hub: every model kvdiff loads is a local file.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

__version__ = "0.1.0"

from kvdiff.engine.loading import load_model  # noqa: E402
from kvdiff.errors import InputError, KvdiffError  # noqa: E402
# Not lazy: importing the submodule kvdiff.compare (for CompareResult, say) would otherwise make
# `kvdiff.compare` the module instead of the function.
from kvdiff.compare import compare  # noqa: E402

__all__ = ["__version__", "load_model", "record", "diff", "compare", "KvdiffError", "InputError"]


def __getattr__(name: str):
    """Lazy exports: the probes and analyzer stages import only when first used."""
    if name == "record":
        from kvdiff.probes.record import record

        return record
    if name == "diff":
        from kvdiff.analysis import diff

        return diff
    raise AttributeError(f"module 'kvdiff' has no attribute {name!r}")

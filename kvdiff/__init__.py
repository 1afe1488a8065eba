"""kvdiff: differential testing and KV-divergence debugging for chunked LLM generation."""

import os

# Never reach a model hub: every model kvdiff loads is a local file.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

__version__ = "0.1.0"

from kvdiff.engine.loading import load_model  # noqa: E402
from kvdiff.errors import InputError, KvdiffError  # noqa: E402

__all__ = ["__version__", "load_model", "record", "diff", "compare", "KvdiffError", "InputError"]


def __getattr__(name: str):
    """Lazy exports: the probes, analyzer and compare stages import only when first used."""
    if name == "record":
        from kvdiff.probes.record import record

        return record
    if name == "diff":
        from kvdiff.analysis import diff

        return diff
    if name == "compare":
        from kvdiff.compare import compare

        return compare
    raise AttributeError(f"module 'kvdiff' has no attribute {name!r}")

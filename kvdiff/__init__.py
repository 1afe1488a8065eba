"""kvdiff: differential testing and KV-divergence debugging for chunked LLM generation."""

import os

# Never reach a model hub: every model kvdiff loads is a local file.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

__version__ = "0.1.0"

from kvdiff.engine.loading import load_model  # noqa: E402
from kvdiff.errors import InputError, KvdiffError  # noqa: E402

__all__ = ["__version__", "load_model", "diff", "KvdiffError", "InputError"]


def __getattr__(name: str):
    """Lazy exports: `kvdiff.diff` imports the analyzer on first use."""
    if name == "diff":
        from kvdiff.analysis import diff

        return diff
    raise AttributeError(f"module 'kvdiff' has no attribute {name!r}")

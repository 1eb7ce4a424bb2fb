#!/usr/bin/env bash
# One-time set-up on a fresh machine: OpenBLAS on Debian/Ubuntu (MLX's CPU backend
# is ~30x faster with it), a virtual environment in .venv, the package with test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(uname -s)" = Linux ] && [ ! -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 ] \
   && [ ! -e /usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3 ] && command -v apt-get >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libopenblas0-pthread >/dev/null
fi
# Headless Chromium and its driver for the web app's browser tests (tests/test_webapp.py).
if [ "$(uname -s)" = Linux ] && command -v apt-get >/dev/null \
   && { ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; }; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test]"
# mlx-vlm for the image tests (tests/test_vlm.py), without its dependencies: the `vlm` extra pulls
# in pyarrow, pandas, opencv, datasets, mlx-audio...; importing its models, processors and generate
# needs only transformers, pillow, jinja2, tqdm (already here) and requests (in the test extra).
.venv/bin/python -m pip install -q --no-deps "mlx-vlm>=0.7.10,<0.8"
# The real Claude Code CLI for the integration tests (tests skip without npm). Pinned: the bundled
# model was trained on this version's prompt (training/capture_sessions.py), and the end-to-end
# test runs it.
if command -v npm >/dev/null && [ ! -x .node/node_modules/.bin/claude ]; then
  npm install --prefix .node --silent --no-audit --no-fund @anthropic-ai/claude-code@2.1.197 >/dev/null
fi
# The real Codex CLI (OpenAI Responses API) for the server tests, pinned likewise.
if command -v npm >/dev/null && [ ! -x .node/node_modules/.bin/codex ]; then
  npm install --prefix .node --silent --no-audit --no-fund @openai/codex@0.171.0 >/dev/null
fi
# PyTorch (CPU) for the training tests (tests/test_hybrid_training.py: the PyTorch hybrid decoder
# equals mlx-lm's on its export), from a local CPU wheel where the machine has one (PyPI's
# default torch pulls CUDA libraries); without it those tests skip.
PYTAG=$(.venv/bin/python -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
TORCH_WHEEL=$(ls /opt/wheels/torch-*+cpu-"$PYTAG"-*.whl 2>/dev/null | head -1 || true)
if [ -n "$TORCH_WHEEL" ] && ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "$TORCH_WHEEL" safetensors || echo "setup: torch not installed; training tests skip"
fi

#!/usr/bin/env bash
# The test suite, with OpenBLAS preloaded where it exists (see engine/base/platform.py).
set -euo pipefail
cd "$(dirname "$0")/.."
for lib in /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 /usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3; do
  [ -e "$lib" ] && export LD_PRELOAD="$lib" && break
done
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"

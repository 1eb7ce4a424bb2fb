#!/usr/bin/env bash
# The test suite, with OpenBLAS preloaded where it exists (see engine/base/platform.py).
# With arguments: only those (`bash scripts/test.sh tests/test_x.py -k name`).
set -euo pipefail
cd "$(dirname "$0")/.."
for lib in /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 /usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3; do
  [ -e "$lib" ] && export LD_PRELOAD="$lib" && break
done
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider)
if [ $# -gt 0 ]; then
  exec "${pytest[@]}" "$@"
fi
"${pytest[@]}"
# The machine-sensitive tests again on other kernels (OpenBLAS's older core type, then numpy in
# place of the compiled C ones): no assertion may hold only for this CPU's kernels (issue 35).
case "$(uname -m)" in
  x86_64) core=(OPENBLAS_CORETYPE=Haswell) ;;
  aarch64 | arm64) core=(OPENBLAS_CORETYPE=ARMV8) ;;
  *) core=() ;;
esac
kernels=(tests/test_cpu_attention.py tests/test_cpu_swiglu.py tests/test_native.py tests/test_gated_delta_chunked.py
         tests/test_batch_cache.py)
lossless=(tests/test_lossless.py::test_engine_baseline_equals_mlx_lm "tests/test_lossless.py::test_greedy_lookup_equals_mlx_lm[qwen3]")
env ${core[@]+"${core[@]}"} "${pytest[@]}" -m "not slow" "${kernels[@]}" "${lossless[@]}"
env ${core[@]+"${core[@]}"} MLX_DSPARK_NATIVE=0 "${pytest[@]}" -m "not slow" tests/test_cpu_attention.py tests/test_native.py

#!/usr/bin/env bash
# Continuous batching on a GPU (MLX CUDA or Metal): `benchmark --concurrency` figures for the
# bundled model and a bigger random qwen3, float32 and bfloat16, without starlette (the engine
# only: scripts/bench_concurrency.py --no-http). From the repository root:
#
#     bash scripts/bench_batch_gpu.sh OUT_DIR [random-model size flags for make_random_model.py]
#
# Writes OUT_DIR/concurrency_<model>_<dtype>.json and OUT_DIR/progress.log; measurement caches
# (cost curve, batch surface) go to OUT_DIR/cache. Each pass is capped (PASS_S, default 90 s),
# so the whole run stays under ~7 minutes; a pass cut short says so and the next one runs.
# Environment: MODELS ("bundled random"), DTYPES ("bfloat16 float32"), LEVELS (1,4), TRIALS (2),
# MAX_TOKENS (128), PASS_S (90), PYTHON (python3), RANDOM_MODEL_DIR; a PYTHONPATH given (an MLX build
# installed with pip --target) is kept after the repository.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bench_batch_gpu.sh OUT_DIR [make_random_model.py flags]}
shift
size=("$@")
[ ${#size[@]} -eq 0 ] && size=(--hidden 2048 --layers 16 --heads 16 --kv-heads 4 --head-dim 128 --intermediate 6144)
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} MLX_DSPARK_NO_REEXEC=1 HF_HUB_OFFLINE=1 MLX_DSPARK_CACHE_DIR="$out/cache"
py=${PYTHON:-python3}
levels=${LEVELS:-1,4}
$py -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), mx.device_info().get('device_name', ''))"
random_dir=${RANDOM_MODEL_DIR:-/tmp/mlx-dspark-random-model}  # outside OUT_DIR: its weights don't come back
if [[ " ${MODELS:-bundled random} " == *" random "* && ! -e "$random_dir/config.json" ]]; then
  $py scripts/make_random_model.py "$random_dir" "${size[@]}" || exit 1
fi
for model in ${MODELS:-bundled random}; do
  for dt in ${DTYPES:-bfloat16 float32}; do
    args=(--contents chat,refactor --concurrency "$levels" --trials "${TRIALS:-2}" --max-tokens "${MAX_TOKENS:-128}"
          --dtype "$dt" --no-http --tune --json-file "$out/concurrency_${model}_$dt.json")
    [ "$model" = random ] && args+=(--model "$random_dir")
    echo "== $model $dt"
    timeout "${PASS_S:-90}" $py scripts/bench_concurrency.py "${args[@]}" 2>>"$out/progress.log" \
      || echo "FAILED or cut short: $model $dt (rc $?); the rows printed above were measured"
  done
done

#!/usr/bin/env bash
# The yardsticks at real cost on a GPU (MLX CUDA or Metal): the bundled model widened to Qwen3-8B's
# shape and to Qwen3-30B-A3B's MoE shape (training/widen.py, quantised as written), the bundled hybrid
# to Qwen3.6-35B-A3B's (training/widen_hybrid.py), then for each
# `benchmark --contents refactor,edit,chat` against mlx-lm, a verify round of refactor and of edit
# against bare forwards of its inputs (scripts/profile_rounds.py), the concurrency benchmark (1, 4, 8
# streams), a 16k-token cold prefill against mlx-lm's (scripts/profile_prefill_gpu.py) and the
# agent sessions against mlx_lm.server (scripts/replay_agent.py, both fixtures). From the repository root:
#
#     bash scripts/real_cost_bench.sh OUT_DIR
#
# Writes OUT_DIR/<shape>_q<bits>_{build,tune,benchmark,rounds_*,concurrency,...}.log, the JSON of each
# measuring pass (<shape>_q<bits>_benchmark.json, _rounds_refactor.json, _concurrency.json, ...), the
# replay's server logs (<shape>_q<bits>_replay_<fixture>_serve.log, _mlx_lm_server.log) and OUT_DIR/progress.log;
# measurement caches (cost curve, batch surface) go to OUT_DIR/cache. The models are built under
# MODELS_DIR (default /tmp/yardsticks, outside OUT_DIR: their weights don't come back; the 8-bit
# MoE is ~42 GB) and removed after their passes unless KEEP=1. Every pass is capped with `timeout`
# (BUILD_S 180, TUNE_S 240, BENCH_S 150, CONC_S 120; the build is the part that varies with the
# disk, and a fresh machine's first process also compiles MLX's kernels for a minute or more: on an
# H100 a 90 s tune was cut short and the benchmark then measured the curve inside its own cap);
# a pass cut short says so and the next one runs. The warm-up
# pass (`tune`) measures the verify cost curve and prefill chunk into the cache and compiles the
# kernels, so neither is charged to the benchmark's first measured side (which also alternates
# who goes first); the concurrency benchmark warms up by itself as well.
# Environment: SHAPES ("qwen3-8b qwen3-30b-a3b qwen3.6-35b-a3b"), QBITS ("8"; "4 8" for both), PASSES (which
# passes, default "tune benchmark rounds concurrency prefill replay"; all of them take about 15 minutes a
# model on an H200, 45 for the three, so a machine whose calls end at 10 minutes runs them in two calls with KEEP=1),
# FIXTURES (replay_agent's names or .jsonl paths: "rename-session long-session", read from
# ../shared/fixtures), TRIALS (2), MAX_TOKENS (unset: each content's own budget), PYTHON (python3),
# MODELS_DIR, KEEP, and the caps ROUNDS_S (120 each), PREFILL_S (180), REPLAY_S (200); a PYTHONPATH given (an MLX build
# installed with pip --target) is kept after the repository.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: real_cost_bench.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} MLX_DSPARK_NO_REEXEC=1 HF_HUB_OFFLINE=1 MLX_DSPARK_CACHE_DIR="$out/cache"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
models_dir=${MODELS_DIR:-/tmp/yardsticks}
trials=${TRIALS:-2}
budget=()
[ -n "${MAX_TOKENS:-}" ] && budget=(--max-tokens "$MAX_TOKENS")
wants() { [[ " ${PASSES:-tune benchmark rounds concurrency prefill replay} " == *" $1 "* ]]; }
log() { echo "$(date -u +%H:%M:%S) $*" | tee -a "$out/progress.log"; }

# pass NAME SECONDS COMMAND...: run one capped pass, its output in OUT_DIR/NAME.log
pass() {
  local name=$1 limit=$2
  shift 2
  log "start $name (cap ${limit}s)"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  [ $rc -eq 0 ] && log "done $name" || log "FAILED or cut short: $name (rc $rc); its log has what was measured"
  return $rc
}

$py -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), mx.device_info().get('device_name', ''))" \
  | tee -a "$out/progress.log"
git log -1 --format='commit %H %cI' 2>/dev/null | tee -a "$out/progress.log"
df -h "$(dirname "$models_dir")" | tail -1 | tee -a "$out/progress.log"
for shape in ${SHAPES:-qwen3-8b qwen3-30b-a3b qwen3.6-35b-a3b}; do
  for bits in ${QBITS:-8}; do
    tag="${shape}_q$bits"
    model="$models_dir/$tag"
    case "$shape" in  # the hybrid shapes widen the bundled hybrid, the others the bundled qwen3
      qwen3.6-*) build=(training/widen_hybrid.py engine/reference_model_hybrid) ;;
      *) build=(training/widen.py engine/reference_model) ;;
    esac
    if [ ! -e "$model/config.json" ]; then
      rm -rf "$model"
      pass "${tag}_build" "${BUILD_S:-180}" $py "${build[@]}" "$model" \
        --shape "$shape" --q-bits "$bits" --dtype bfloat16 || { rm -rf "$model"; continue; }
    fi
    du -sh "$model" | tee -a "$out/progress.log"
    wants tune && pass "${tag}_tune" "${TUNE_S:-240}" $py -m agent_bridge tune --model "$model"
    wants benchmark && pass "${tag}_benchmark" "${BENCH_S:-150}" $py -m agent_bridge benchmark --model "$model" \
      --contents refactor,edit,chat --trials "$trials" "${budget[@]}" --json-file "$out/${tag}_benchmark.json"
    if wants rounds; then  # a round through the engine against bare forwards of its inputs (scripts/profile_rounds.py)
      for content in refactor edit; do
        pass "${tag}_rounds_$content" "${ROUNDS_S:-120}" $py scripts/profile_rounds.py --model "$model" \
          --content $content --json "$out/${tag}_rounds_$content.json"
      done
    fi
    wants concurrency && pass "${tag}_concurrency" "${CONC_S:-120}" $py scripts/bench_concurrency.py --model "$model" \
      --contents chat,refactor --concurrency 1,4,8 --trials "$trials" --max-tokens "${MAX_TOKENS:-128}" \
      --no-http --tune --json-file "$out/${tag}_concurrency.json"
    wants prefill && pass "${tag}_prefill" "${PREFILL_S:-180}" $py scripts/profile_prefill_gpu.py --model "$model" \
      --chunks 2048,4096 --skip dequantized
    if wants replay; then
      for fixture in ${FIXTURES:-rename-session long-session}; do
        name=$(basename "$fixture" .jsonl)
        pass "${tag}_replay_$name" "${REPLAY_S:-200}" $py scripts/replay_agent.py --fixtures "$fixture" \
          --model "$model" --no-restarts --context-window 65536 --work-dir "$models_dir/replay-$tag-$name" \
          --json "$out/${tag}_replay_$name.json"
        for log in "$models_dir/replay-$tag-$name"/*.log; do  # the servers' own logs come back too
          [ -e "$log" ] && cp "$log" "$out/${tag}_replay_${name}_$(basename "$log")"
        done
      done
    fi
    [ "${KEEP:-0}" = 1 ] || rm -rf "$model" "$models_dir/replay-$tag-"*
  done
done
log "all passes done"

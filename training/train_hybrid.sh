#!/usr/bin/env bash
# The hybrid reference model (qwen3_5: Gated DeltaNet + full attention, ~12.4M parameters) in one
# command on the GPU machine, from the repository root: stage 1 + stage 2 of the bundled qwen3's
# recipe within BUDGET seconds of training, export, and (where mlx_lm is importable) the MLX
# 8-bit copy. Nothing is downloaded: the corpus is the interpreter's site-packages and the
# tokenizer is engine/reference_model's.
#
#   BUDGET=420 OUT=/some/dir bash training/train_hybrid.sh
#
# Writes to $OUT (at most 8 files, each < 16 MB):
#   train.log                      both stages' logs (tokens/s every LOG_EVERY steps)
#   model_mlx8/ (mlx_lm present)   config.json generation_config.json model.safetensors
#                                  tokenizer.json tokenizer_config.json train_stats.json
#   model_bf16/ (otherwise)        config.json generation_config.json model-0000{1,2}-of-00002.safetensors
#                                  tokenizer.json tokenizer_config.json train_stats.json
# A model_bf16/ becomes the package's 8-bit copy on any machine with mlx-lm:
#   python training/quantize_mlx.py OUT/model_bf16 engine/reference_model_hybrid
# Wall time is about BUDGET + 2-3 minutes (corpus reading twice, validation, export, sanity).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-/opt/torch/.venv/bin/python3}
[ -x "$PY" ] || PY=python3
BUDGET=${BUDGET:-420}              # training seconds, both stages (the qwen3 recipe: 420 + 255)
OUT=${OUT:-/tmp/hybrid_out}
WORK=${WORK:-/tmp/hybrid_work}
SEQ=${SEQ:-8192}
BATCH=${BATCH:-16}
CHUNK=${CHUNK:-64}
LOG_EVERY=${LOG_EVERY:-10}
WORKERS=${WORKERS:-$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))}
EXTRA=${EXTRA:-}                   # more train.py flags for both stages (CPU smoke: --tiny --max-files 600 ...)
S1=$(( BUDGET * 62 / 100 ))        # 420:255 as in the qwen3 recipe
S2=$(( BUDGET - S1 ))

export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$OUT" "$WORK"
rm -rf "$WORK/stage1" "$WORK/stage2" "$OUT/model_bf16" "$OUT/model_mlx8"
LOG="$OUT/train.log"
: > "$LOG"
say() { echo "[train_hybrid $(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }

say "python $PY budget ${BUDGET}s (stage 1 ${S1}s, stage 2 ${S2}s) seq $SEQ batch $BATCH chunk $CHUNK workers $WORKERS"
COMMON=(--arch qwen3_5 --tokenizer engine/reference_model --seq-len "$SEQ" --batch "$BATCH" --chunk "$CHUNK"
        --workers "$WORKERS" --log-every "$LOG_EVERY")

say "stage 1"
"$PY" training/train.py "${COMMON[@]}" --out "$WORK/stage1" --time-budget "$S1" --sanity 0 $EXTRA 2>&1 | tee -a "$LOG"
FINAL="$WORK/stage1"

say "stage 2"
if "$PY" training/train.py "${COMMON[@]}" --out "$WORK/stage2" --init "$WORK/stage1" --time-budget "$S2" \
    --lr 1e-3 --warmup-steps 30 --mix rename=0.75,edit=0.08,rewrite=0.07,continue=0.03,code=0.05,english=0.02 \
    --pack-retries 4 --seed 4321 --sanity 4 $EXTRA 2>&1 | tee -a "$LOG"; then
  FINAL="$WORK/stage2"
else
  say "stage 2 FAILED: packaging stage 1"
fi

# one train_stats.json with both stages
"$PY" - "$WORK" "$FINAL" <<'EOF'
import json, sys
from pathlib import Path
work, final = Path(sys.argv[1]), Path(sys.argv[2])
stats = {d: json.loads((work / d / "train_stats.json").read_text())
         for d in ("stage1", "stage2") if (work / d / "train_stats.json").exists()}
(final / "train_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
EOF

if "$PY" -c "import mlx_lm" 2>/dev/null; then
  say "mlx_lm found: 8-bit MLX copy"
  "$PY" training/quantize_mlx.py "$FINAL" "$OUT/model_mlx8" 2>&1 | tee -a "$LOG"
else
  say "no mlx_lm here: bf16 export in $OUT/model_bf16 (quantise with training/quantize_mlx.py)"
  mkdir -p "$OUT/model_bf16"
  for f in config.json generation_config.json tokenizer.json tokenizer_config.json train_stats.json "$FINAL"/model-*.safetensors; do
    cp "$FINAL/$(basename "$f")" "$OUT/model_bf16/"
  done
fi
say "done; outputs:"
find "$OUT" -type f -printf '%10s %p\n' | sort -k2 | tee -a "$LOG"

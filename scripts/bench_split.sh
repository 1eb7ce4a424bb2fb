#!/usr/bin/env bash
# The split model against itself undrafted and against mlx-lm's own decoding on the same ranks
# (issue 32), on one process and over 2 ranks on localhost with added link latencies.
#   bash scripts/bench_split.sh [OUT_DIR] [DELAYS_MS...]     (default: /tmp/bench-split, 0 5)
# Env: MODEL (default: the bundled model), SPLIT (tensor), CONTENTS (refactor,edit), MAX_TOKENS (160).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/bench-split}; shift || true
if [ $# -gt 0 ]; then delays=("$@"); else delays=(0 5); fi
mkdir -p "$out"
for lib in /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 /usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3; do
  [ -e "$lib" ] && export LD_PRELOAD="$lib" && break
done
export MLX_DSPARK_NO_REEXEC=1 PYTHONPATH=.
py=.venv/bin/python
bench=(-m agent_bridge benchmark --contents "${CONTENTS:-refactor,edit}" --modes lookup,baseline --trials 1
       --max-tokens "${MAX_TOKENS:-160}" ${MODEL:+--model "$MODEL"})
echo "== one process" >&2
$py "${bench[@]}" --json-file "$out/one.json" | tail -4
for d in "${delays[@]}"; do
  echo "== 2 ranks, ${SPLIT:-tensor} split, ${d} ms between ranks" >&2
  $py -m engine.bench.shaped_link -n 2 --delay-ms "$d" -- $py "${bench[@]}" --split "${SPLIT:-tensor}" \
      --json-file "$out/split-${d}ms.json" | grep -v '^\[1\]' | tail -4
done
$py - "$out" "${delays[@]}" <<'PY'
import json, sys
out, delays = sys.argv[1], sys.argv[2:]
runs = [("one process", f"{out}/one.json")] + [(f"2 ranks, {d} ms", f"{out}/split-{d}ms.json") for d in delays]
# identical: lookup and undrafted equal mlx-lm's decoding in the same run, and that output equals
# one process's (its fingerprint)
print("| run | content | mlx-lm tok/s | undrafted tok/s | lookup tok/s | tok/fwd | lookup / undrafted | lookup / mlx-lm | identical |")
print("|---|---|---|---|---|---|---|---|---|")
one = json.load(open(runs[0][1]))["contents"]
for name, path in runs:
    report = json.load(open(path))
    for content, r in report["contents"].items():
        peer, base, look = r["mlx_lm"], r["modes"]["baseline"], r["modes"]["lookup"]
        same = look["identical"] and base["identical"] and peer["output_sha256"] == one[content]["mlx_lm"]["output_sha256"]
        print(f"| {name} | {content} | {peer['tok_s']} | {base['tok_s']} | {look['tok_s']} | {look['tokens_per_forward']} "
              f"| {look['tok_s'] / base['tok_s']:.2f}x | {look['tok_s'] / peer['tok_s']:.2f}x | {'yes' if same else 'NO'} |")
PY

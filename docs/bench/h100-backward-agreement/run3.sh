#!/usr/bin/env bash
# After the H100 refit (cost_model.H100 from raw-2-h100): the backend row at EP=64 and EP=8, 16384 tokens (what the
# compiled model decides there, beside a2a eager and the saved ring), then the full model at 16384-32768 tokens.
# Usage: bash docs/bench/h100-backward-agreement/run3.sh "$OUT"
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
for ep in 64 8; do
  timeout 150 python -m relay_compile.bench --preset sweep --repeats 5 --warmup 2 --out /tmp/s$ep --ep $ep \
    --tokens 16384 --rows "relaymoe backend" "ring expert saved" 2>&1 | quiet > $OUT/backend-ep$ep-16384.log
  grep "|" $OUT/backend-ep$ep-16384.log | cut -c1-150; cp /tmp/s$ep/sweep.json $OUT/backend-ep$ep-16384.json
done
timeout 240 python -m relay_compile.bench.full_model --preset h200 --memory-gib 76 --rows "a2a eager" relaymoe \
  --start 16384 --max-tokens 32768 --repeats 5 --time-budget 180 --out /tmp/full 2>&1 | quiet > $OUT/full-model.log
tail -14 $OUT/full-model.log; cp /tmp/full/results.md $OUT/full-model.md

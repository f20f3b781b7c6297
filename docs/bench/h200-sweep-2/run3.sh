#!/usr/bin/env bash
# The full model's short lengths (dynamic T: the token switch) and the kept EP=64 backend row at 16384 tokens
# (inductor compiles the kept region: ~220 s), with the H100 constants.
# Usage: bash docs/bench/h200-sweep-2/run3.sh "$OUT"
set -uo pipefail
OUT=$1
source "$(dirname "$0")/setup.sh"
timeout 170 python -m relay_compile.bench.full_model --preset h200 --memory-gib 76 --rows "a2a eager" relaymoe \
  --start 8192 --max-tokens 16384 --repeats 5 --time-budget 120 --out /tmp/full 2>&1 | quiet > $OUT/full-model.log
tail -12 $OUT/full-model.log; cp /tmp/full/results.md $OUT/full-model.md
timeout 300 python -m relay_compile.bench --preset sweep --repeats 5 --warmup 2 --out /tmp/s --ep 64 --tokens 16384 \
  --rows "relaymoe backend" "ring expert" 2>&1 | quiet > $OUT/sweep-ep64-16384-backend.log
grep "|" $OUT/sweep-ep64-16384-backend.log | cut -c1-130; cp /tmp/s/sweep.json $OUT/sweep-ep64-16384-backend.json

#!/usr/bin/env bash
# After the H100 calibration (cost_model.H100, calibration_for): the decisions it changes, measured on the GPU it
# was fitted on, and the full-model row the bar missed by 1% (32768 tokens per rank, EP=8, dynamic T).
# Usage: bash docs/bench/h200-sweep-2/run2.sh "$OUT"
set -uo pipefail
OUT=$1
source "$(dirname "$0")/setup.sh"
# EP=64 32768: the H100 constants run the ring (the backend decides at compile time: no kept compile).
sweep sweep-ep64-32768 120 --ep 64 --tokens 32768 --rows "relaymoe backend" "ring_moe default" "ring expert"
sweep sweep-ep64-16384 60 --ep 64 --tokens 16384 --rows "ring_moe default" "ring expert"
timeout 330 python -m relay_compile.bench.full_model --preset h200 --memory-gib 76 --rows "a2a eager" relaymoe \
  --start 32768 --max-tokens 32768 --repeats 5 --time-budget 240 --out /tmp/full 2>&1 | quiet > $OUT/full-model.log
tail -30 $OUT/full-model.log
cp /tmp/full/*.md $OUT/ 2>/dev/null; ls /tmp/full

#!/usr/bin/env bash
# Issue 24's full-model bars on one GPU (H100: a 76 GiB cap): the capacity search of a2a eager, a2a + full AC and
# relaymoe (the longest tokens per rank each fits; bars: relaymoe >= 3x a2a eager, >= 2x a2a + full AC), then every
# row measured at the comparison lengths (tokens/s, the speed bar).
# Usage: bash docs/bench/h100-saved-projections/run3.sh "$OUT"
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout 520 python -m relay_compile.bench.full_model --preset h200 --memory-gib 76 --out /tmp/fm \
  --rows "a2a eager" "a2a + full AC" relaymoe --time-budget 420 2>&1 | quiet | tee $OUT/full-model.log | tail -40
cp /tmp/fm/results.json /tmp/fm/results.md $OUT/ 2>/dev/null

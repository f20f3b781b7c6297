#!/usr/bin/env bash
# Issue 24, saved projections on one GPU: the A/B (ab.py), then where the ring's GPU time goes (kernel split,
# with and without them), then on an H200 only the sweep without compiled rows (cost_model.H200's refit data).
# Usage: bash docs/bench/h100-saved-projections/run.sh "$OUT"
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
timeout 200 python docs/bench/h100-saved-projections/ab.py --ep 8 64 --tokens 4096 8192 16384 32768 65536 2>&1 | quiet \
  | tee $OUT/ab.txt
timeout 120 python docs/bench/h100-kernel-split/kernel_split.py --ep 8 64 --tokens 16384 --options save_projections=true \
  2>&1 | quiet | tee $OUT/kernel-split.txt
if grep -q H200 $OUT/env.txt; then
  sweep sweep-ep8 120 --ep 8 --no-compile
  sweep sweep-ep64 120 --ep 64 --no-compile
fi

#!/usr/bin/env bash
# Issue 24, where the ring's GPU time goes at 16k tokens (kernel_split.py), then, on an H200 only, the sweep
# without compiled rows (cost_model.H200's refit data: today's ring was never measured on an H200).
# Usage: bash docs/bench/h100-kernel-split/run.sh "$OUT"
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
timeout 240 python docs/bench/h100-kernel-split/kernel_split.py --ep 8 64 --tokens 16384 65536 2>&1 | quiet \
  | tee $OUT/kernel-split.txt
if grep -q H200 $OUT/env.txt; then
  sweep sweep-ep8 120 --ep 8 --no-compile
  sweep sweep-ep64 120 --ep 64 --no-compile
fi

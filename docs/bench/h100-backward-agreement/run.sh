#!/usr/bin/env bash
# Issue 24: the backward's agreement built from its forward's counts (beside the compute stream) against the
# same saved ring whose backward exchange reads the device's counts on the compute stream (as before), a2a eager
# and the recomputing ring beside; then host time per phase and where the GPU idles (EP=8 16384).
# Usage: bash docs/bench/h100-backward-agreement/run.sh "$OUT"
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
timeout 300 python docs/bench/h100-saved-projections/ab.py --ep 8 64 --tokens 16384 32768 65536 --repeats 5 \
  --device-exchange 2>&1 | quiet | tee $OUT/ab.txt
for ep in 8 64; do
  timeout 60 python docs/bench/h100-saved-projections/phases.py --ep $ep --tokens 16384 2>&1 | quiet
done | tee $OUT/phases.txt
timeout 60 python docs/bench/h100-saved-projections/gaps.py --ep 8 --tokens 16384 --row ring 2>&1 | quiet \
  | tee $OUT/gaps.txt

#!/usr/bin/env bash
# The backend's ring against the eager ring's host time per step, EP=64 16384 (host_diag.py), inductor and
# aot_eager as the inner compiler. Usage: bash docs/bench/h100-backend-host/run.sh "$OUT"
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
for inner in inductor aot_eager; do
  timeout 240 python docs/bench/h100-backend-host/host_diag.py --ep 64 --tokens 16384 --inner $inner 2>&1 | quiet
done | tee $OUT/host-diag.txt

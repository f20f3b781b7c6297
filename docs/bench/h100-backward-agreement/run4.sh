#!/usr/bin/env bash
# Why the backend's ring at EP=64 16384 is slower than ring_moe's (raw-3): host time per phase of both, compiled
# and eager, and whether each backward was given its forward's counts.
# Usage: bash docs/bench/h100-backward-agreement/run4.sh "$OUT"
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
for flag in --backend ""; do
  timeout 150 python docs/bench/h100-saved-projections/phases.py --ep 64 --tokens 16384 $flag 2>&1 | quiet
done | tee $OUT/phases.txt

#!/usr/bin/env bash
# The backend's ring with inductor against aot_eager as inner compiler, and ring_moe eager (phases.py), EP=64 16384.
# Usage: bash docs/bench/h100-backward-agreement/run7.sh "$OUT"
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
for args in "--backend --inner aot_eager" "--backend --inner inductor" ""; do
  timeout 100 python docs/bench/h100-saved-projections/phases.py --ep 64 --tokens 16384 $args 2>&1 | quiet
done | tee $OUT/phases.txt

#!/usr/bin/env bash
# Where the GPU idles in one step of the ring (default options, forced) and of a2a, EP=8 16384 (gaps.py).
# Usage: bash docs/bench/h100-saved-projections/run4.sh "$OUT"
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
for row in ring a2a; do
  timeout 45 python docs/bench/h100-saved-projections/gaps.py --ep 8 --tokens 16384 --row $row 2>&1 | quiet
done | tee $OUT/gaps.txt

#!/usr/bin/env bash
# Issue 24 after run.sh, bounded for a short lease: where the expert ring's GPU time goes at EP=8 16384 with the
# Triton kernels named (kernel_split.py: recomputing vs reading saved projections), where the GPU idles in one
# step of the ring and of a2a (gaps.py), and the A/B at 16384 with chunk graphs beside.
# Usage: bash docs/bench/h100-saved-projections/run2.sh "$OUT"
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
timeout 60 python docs/bench/h100-kernel-split/kernel_split.py --ep 8 --tokens 16384 --options save_projections=true \
  --top 14 2>&1 | quiet | tee $OUT/kernel-split.txt
for row in ring a2a; do
  timeout 45 python docs/bench/h100-saved-projections/gaps.py --ep 8 --tokens 16384 --row $row 2>&1 | quiet
done | tee $OUT/gaps.txt
timeout 120 python docs/bench/h100-saved-projections/ab.py --ep 8 64 --tokens 16384 --repeats 5 --graphs 2>&1 | quiet \
  | tee $OUT/ab.txt

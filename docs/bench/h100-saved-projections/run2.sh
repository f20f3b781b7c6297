#!/usr/bin/env bash
# Issue 24 after run.sh: where the expert ring's GPU time goes at 16384 tokens with the Triton kernels named
# (kernel_split.py: ring recomputing vs reading saved projections), where its host time goes at EP=8
# (profile_hop.py: op census and cProfile), and the A/B again at 16384-32768 with 7 rounds, chunk graphs beside.
# Usage: bash docs/bench/h100-saved-projections/run2.sh "$OUT"
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
timeout 120 python docs/bench/h100-kernel-split/kernel_split.py --ep 8 64 --tokens 16384 --options save_projections=true \
  --top 14 2>&1 | quiet | tee $OUT/kernel-split.txt
mkdir -p /tmp/prof
timeout 90 python docs/bench/h200-hop-host/profile_hop.py /tmp/prof --ep 8 --tokens 16384 > /dev/null 2>&1
cp /tmp/prof/census-ep8-16384.txt /tmp/prof/profile-ep8-16384-tottime.txt $OUT/ 2>/dev/null
head -30 $OUT/census-ep8-16384.txt; head -60 $OUT/profile-ep8-16384-tottime.txt | tail -48
for row in ring a2a; do
  timeout 60 python docs/bench/h100-saved-projections/gaps.py --ep 8 --tokens 16384 --row $row 2>&1 | quiet
done | tee $OUT/gaps.txt
timeout 200 python docs/bench/h100-saved-projections/ab.py --ep 8 64 --tokens 16384 32768 --repeats 7 --graphs 2>&1 | quiet \
  | tee $OUT/ab.txt

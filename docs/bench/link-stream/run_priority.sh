#!/usr/bin/env bash
# The stand-in's 16-block link at the device's highest stream priority (link_high_priority), beside the plain
# 16-block link: whether a copy beside a GEMM overlaps it, queued after or before it (concurrency.py); the
# high-priority row's copies beside its kernels by pass (overlap.py --places); the forced ring on the plain
# stand-in and on both 16-block links, EP=8 65536 tokens, 5 interleaved rounds.
# Usage: bash docs/bench/link-stream/run_priority.sh OUT
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
timeout 90 python docs/bench/link-stream/concurrency.py 2>&1 | quiet | tee $OUT/concurrency.txt
timeout 120 python docs/bench/link-stream/overlap.py --places $OUT \
  --rows "ring auto, link stream of 16 CTAs, high priority" 2>&1 | quiet | grep -v "^\[" \
  | tee $OUT/overlap-ctas-high-ep8-65536.txt
rm -f $OUT/overlap_*.json
sweep priority-ep8 120 --ep 8 --tokens 65536 --no-compile --rows "ring auto" "ring auto, link stream of 16 CTAs" \
  "ring auto, link stream of 16 CTAs, high priority"

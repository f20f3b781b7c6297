#!/usr/bin/env bash
# Kernel time by class of the backend's ring against ring_moe's and a2a eager, EP=64 16384 (kernel_split.py).
# Usage: bash docs/bench/h100-backward-agreement/run6.sh "$OUT"
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
timeout 200 python docs/bench/h100-kernel-split/kernel_split.py --ep 64 --tokens 16384 --backend --top 16 2>&1 \
  | quiet | tee $OUT/kernel-split.txt

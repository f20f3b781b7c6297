#!/usr/bin/env bash
# The backward's sums posted as a batch of their own ahead of the weights, against one batch (sums_first.py), at
# EP=8 and EP=64, 65536 tokens; with CHECK=1 on an H200, the bar sweep (h200-check/run.sh) first.
# Usage: [CHECK=1] bash docs/bench/link-stream/run_sums_first.sh OUT
set -uo pipefail
OUT=$1
if [ "${CHECK:-0}" = 1 ] && python -c "import torch, sys; sys.exit(0 if 'H200' in torch.cuda.get_device_name() else 1)"; then
  mkdir -p $OUT/check
  bash docs/bench/h200-check/run.sh $OUT/check 2>&1 | grep "|" | cut -c1-170 | tail -30
fi
source docs/bench/h200-sweep-2/setup.sh
for ep in 8 64; do
  timeout 150 python docs/bench/link-stream/sums_first.py --ep $ep --tokens 65536 2>&1 | quiet \
    | tee $OUT/sums-first-ep$ep-65536.txt
done

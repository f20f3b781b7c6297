#!/usr/bin/env bash
# Token routing's stacked sources against one source per hop (token_stacks.py, EP=64 4096-16384 tokens), then on
# an H200 the bar sweep without compiled rows (h200-check/run.sh, whose "ring token" rows now hold the rules'
# sources per hop). Usage: bash docs/bench/token-stacks/run.sh OUT
set -uo pipefail
OUT=$1
mkdir -p $OUT
source docs/bench/h200-sweep-2/setup.sh
t0=$SECONDS
timeout 200 python docs/bench/token-stacks/token_stacks.py --ep 64 --tokens 4096 8192 16384 2>&1 | quiet \
  | tee $OUT/token-stacks-ep64.txt | grep "|\|EP="
echo "token stacks [$((SECONDS-t0)) s]"
if python -c "import torch, sys; sys.exit(0 if 'H200' in torch.cuda.get_device_name() else 1)"; then
  mkdir -p $OUT/check
  bash docs/bench/h200-check/run.sh $OUT/check 2>&1 | tail -75
fi

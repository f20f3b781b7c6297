#!/usr/bin/env bash
# On an H200 only (else it stops at once): the bar sweep without compiled rows (h200-check/run.sh: a2a eager,
# ring_moe default and the forced rings, EP 8 and 64, 4096-131072 tokens, 5 interleaved rounds; its "ring token"
# rows now hold the rules' sources per hop and add their sums in place), and the committed H200 constants' check.
# Usage: bash docs/bench/token-stacks/run_h200.sh OUT
set -uo pipefail
OUT=$1
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "import torch, sys; sys.exit(0 if 'H200' in torch.cuda.get_device_name() else 1)" || { echo "not an H200"; exit 0; }
mkdir -p $OUT/check
bash docs/bench/h200-check/run.sh $OUT/check 2>&1 | tail -75

#!/usr/bin/env bash
# The sweep without compiled rows (EP 8 and 64, 4096-131072 tokens per rank; a2a eager, ring_moe default and
# the rings, 5 interleaved rounds), then how the committed constants of this card predict it. Checks the refit
# of 2026-12-06 (cost_model.ring_traffic) and the 0.7x bar at EP=8 65536 on one machine.
# Usage: bash docs/bench/h200-check/run.sh OUT
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
sweep sweep-ep8 150 --ep 8 --no-compile
sweep sweep-ep64 150 --ep 64 --no-compile
card=$(python -c "import torch; print('h200' if 'H200' in torch.cuda.get_device_name() else 'h100')")
python -m relay_compile.bench.calibrate --check "$card" $OUT/sweep-ep8.json $OUT/sweep-ep64.json 2>&1 \
  | tee $OUT/check-$card.txt | tail -70

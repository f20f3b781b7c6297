#!/usr/bin/env bash
# On an H200 only (else it stops at once): the bar sweep without compiled rows at EP=8 (a2a eager, ring_moe default
# and the forced rings, 4096-131072 tokens, 5 interleaved rounds): the 0.7x bar at 65536 and the ring at 16384, when
# the device time left does not cover run_h200.sh. Usage: bash docs/bench/token-stacks/run_h200_ep8.sh OUT
set -uo pipefail
OUT=$1
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "import torch, sys; sys.exit(0 if 'H200' in torch.cuda.get_device_name() else 1)" || { echo "not an H200"; exit 0; }
source docs/bench/h200-sweep-2/setup.sh
sweep sweep-ep8 170 --ep 8 --no-compile

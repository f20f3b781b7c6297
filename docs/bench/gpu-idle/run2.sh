#!/usr/bin/env bash
# EP=8 65536 `ring_moe default` against a2a eager in 5 interleaved rounds (the 0.7x bar) with the agreement's
# header queued from pinned memory and the sums zeroed first, then the kept region at EP=64 8192 beside a2a eager
# (idle gaps, runtime calls per step: where the compiled graph's 1.15-1.30x goes). Everything goes to stdout (the device returns few files).
# Usage: bash docs/bench/gpu-idle/run2.sh OUT
set -uo pipefail
OUT=$1
BUDGET=${BUDGET:-300}
source docs/bench/h200-sweep-2/setup.sh
fits() { [ $((SECONDS + $1)) -lt "$BUDGET" ] || { echo "skipped (budget): $2"; false; }; }
fits 100 ep8 && sweep ep8-65536 100 --ep 8 --tokens 65536 --rows "ring_moe default"
fits 150 kept && timeout 150 python -m relay_compile.bench.gpu_idle --ep 64 --tokens 8192 --rows "a2a eager" "relaymoe backend" --steps 2 --top 12 2>&1 | quiet | grep -v "^\["

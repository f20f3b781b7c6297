#!/usr/bin/env bash
# Issue 24's GPU levers in one call, most telling first, each part skipped once the call's budget (BUDGET
# seconds, default 540) would not hold it: the new kernels' CUDA tests, what a kernel launch costs the host
# (hop-host/launch.py), the scatter-add's tile x warps and the ring with the fastest and with SwiGLU's forward
# eager, the per-kernel census, where the forced ring's host time goes (hop-host/host_profile.py), and the kept
# region's exchange. Usage: bash docs/bench/ep8-gpu/run.sh OUT
set -uo pipefail
OUT=$1
BUDGET=${BUDGET:-540}
source docs/bench/h200-sweep-2/setup.sh
fits() { [ $((SECONDS + $1)) -lt "$BUDGET" ] || { echo "skipped (budget): $2"; false; }; }
timeout 60 python -m pytest -q tests/test_swiglu_forward.py tests/test_scatter_add_rows.py 2>&1 | tail -2 | tee $OUT/tests.log
timeout 40 python docs/bench/hop-host/launch.py 2>&1 | quiet | tee $OUT/launch.log
fits 200 scatter_tune && { timeout 200 python docs/bench/ep8-gpu/scatter_tune.py 2>&1 | quiet | tee $OUT/scatter_tune.log | grep -v "^  BLOCK"; }
fits 90 kernels && { timeout 90 python docs/bench/ep8-gpu/kernels.py 2>&1 | quiet > $OUT/kernels.log
  grep "==\|scatter_add\|swiglu\|elementwise_kernel<128" $OUT/kernels.log | cut -c1-140; }
for shape in "64 4096" "8 16384"; do
  set -- $shape
  fits 60 "profile $1 $2" && { timeout 60 python docs/bench/hop-host/host_profile.py --ep $1 --tokens $2 2>&1 | quiet > $OUT/host-profile-ep$1-$2.log
    head -1 $OUT/host-profile-ep$1-$2.log; }
done
# The kept region's exchange beside the compute stream: with and without it (EP=64, 8192 tokens, aot_eager inner).
fits 140 kept && { timeout 140 python docs/bench/h200-kept/diag.py --ep 64 --tokens 8192 --repeats 9 --deadline 130 \
  --rows eager "relaymoe/aot_eager" "relaymoe/aot_eager, no agreement" 2>&1 | quiet > $OUT/kept-ep64-8192.log
  grep "|" $OUT/kept-ep64-8192.log; }

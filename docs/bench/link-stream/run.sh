#!/usr/bin/env bash
# The stand-in with its transfers on a stream of their own (standin_group(n, link_stream=True)): the numerics
# check and step times on CUDA (check.py); whether the link stream's copies run beside kernels (overlap.py); the forced ring ("ring auto") on both stand-ins beside a2a eager,
# 5 interleaved rounds, at the bar's token counts (16384 and 65536; EP=8 131072); the EP=8 65536 idle gaps after
# runtime.queued_ahead (compare docs/bench/gpu-idle/raw-1-h100); the host time per step against the device's of the
# forced ring at EP=64 and EP=8 16384 (GPU-bound or not, and where its host time goes). SHORT=1: EP=8 16384/65536 and EP=64
# 65536 only.
# Usage: [SHORT=1] bash docs/bench/link-stream/run.sh OUT
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
timeout 120 python docs/bench/link-stream/check.py --ep 8 --tokens 16384 2>&1 | quiet | tee $OUT/check.txt
timeout 120 python docs/bench/link-stream/overlap.py $OUT 2>&1 | quiet | grep -v "^\[" | tee $OUT/overlap-ep8-65536.txt
rm -f $OUT/overlap_*.json  # the traces (large); the table above is what they give
rows=("ring auto" "ring auto, link stream" "ring_moe default, link stream")
if [ "${SHORT:-0}" = 1 ]; then
  sweep link-ep8 130 --ep 8 --tokens 16384 65536 --no-compile --rows "${rows[@]}"
  sweep link-ep64 100 --ep 64 --tokens 65536 --no-compile --rows "${rows[@]}"
else
  sweep link-ep8 150 --ep 8 --tokens 16384 65536 131072 --no-compile --rows "${rows[@]}"
  sweep link-ep64 120 --ep 64 --tokens 16384 65536 --no-compile --rows "${rows[@]}"
fi
for ep in 64 8; do  # the forced ring's host time per step against the device's, and where it goes (cProfile)
  timeout 45 python docs/bench/hop-host/host_profile.py --ep $ep --tokens 16384 --top 30 2>&1 | quiet \
    > $OUT/host-ep$ep-16384.log; head -1 $OUT/host-ep$ep-16384.log
done
timeout 90 python -m relay_compile.bench.gpu_idle --ep 8 --tokens 65536 --rows "a2a eager" "ring expert" 2>&1 \
  | quiet > $OUT/idle-ep8-65536.log; grep -v "^\[" $OUT/idle-ep8-65536.log | head -40

#!/usr/bin/env bash
# Where the GPU waits on the host (issue 24): idle gaps and syncs of the EP=8 65536 ring (the 0.7x bar: its
# kernels sum to ~0.69x a2a's, its step to ~0.74x) and of the EP=64 4096 forced ring (host-bound: runtime calls
# per hop pass), the backend at EP=64 16384, the host cost of a launch, and the forced ring's cProfile. One budgeted device call
# (BUDGET seconds, default 540). Usage: bash docs/bench/gpu-idle/run.sh OUT
set -uo pipefail
OUT=$1
BUDGET=${BUDGET:-540}
source docs/bench/h200-sweep-2/setup.sh
fits() { [ $((SECONDS + $1)) -lt "$BUDGET" ] || { echo "skipped (budget): $2"; false; }; }
idle() { local name=$1 limit=$2; shift 2; fits $limit $name && { timeout $limit python -m relay_compile.bench.gpu_idle "$@" 2>&1 | quiet > $OUT/$name.log; grep -v "^\[" $OUT/$name.log | head -${LINES_SHOWN:-60}; }; }
idle ep8-65536 150 --ep 8 --tokens 65536 --rows "a2a eager" "ring_moe default" "ring expert"
# The backend at EP=64 16384, which the corrected time model now runs as a ring (it kept the all-to-all there).
fits 170 backend && sweep backend-ep64-16384 170 --ep 64 --tokens 16384 --rows "relaymoe backend" "ring_moe default"
# The kept region at EP=64 8192 (1.15-1.30x a2a eager): what its compiled graph launches and waits on, beside eager's.
idle kept-ep64-8192 150 --ep 64 --tokens 8192 --rows "a2a eager" "relaymoe backend" --steps 2
fits 40 launch && { timeout 40 python docs/bench/hop-host/launch.py 2>&1 | quiet | tee $OUT/launch.log; }
idle ep64-4096 120 --ep 64 --tokens 4096 --rows "ring expert" --steps 2
LINES_SHOWN=30 idle ep8-65536-stack 120 --ep 8 --tokens 65536 --rows "ring_moe default" --steps 1 --stack --depth 3
LINES_SHOWN=30 idle ep64-4096-stack 100 --ep 64 --tokens 4096 --rows "ring expert" --steps 1 --stack --depth 3
fits 60 profile && { timeout 60 python docs/bench/hop-host/host_profile.py --ep 64 --tokens 4096 --steps 3 2>&1 | quiet > $OUT/host-profile-ep64-4096.log; head -1 $OUT/host-profile-ep64-4096.log; }

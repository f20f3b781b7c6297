#!/usr/bin/env bash
# After raw-1-h100 (the epilogue at 4 stages; under gather_in_gemm SwiGLU's forward and backward in the first
# projection's epilogue, and the backward's first GEMMs reading rows at their indices and storing them for the
# weight gradients): what decides the two options' defaults, most telling first, each part skipped once the
# call's budget (BUDGET seconds, default 540) would not hold it: the kernels' CUDA tests; the forced ring at EP=8 65536 with and without each option (twice, apart, for
# the spread); the per-kernel census of the ring with and without both; EP=64 16384 (host-bound: do the Triton
# launches cost the host more than the gathers they replace?); EP=64 65536; the kernel table again (its y add's
# baseline now scales in the scatter-add, as the ring does). Usage: bash docs/bench/gathered-gemm/run2.sh OUT
set -uo pipefail
OUT=$1
BUDGET=${BUDGET:-540}
source docs/bench/h200-sweep-2/setup.sh
fits() { [ $((SECONDS + $1)) -lt "$BUDGET" ] || { echo "skipped (budget): $2"; false; }; }
ROWS=("ring auto" "ring auto, gather in GEMM" "ring auto, add in GEMM" "ring auto, gather and add in GEMM")
timeout 45 python -m pytest -q -p no:cacheprovider tests/test_gathered_grouped_mm.py 2>&1 | tail -2 | tee $OUT/tests.txt
fits 60 ab-ep8-1 && sweep ab-ep8-1 60 --ep 8 --tokens 65536 --rows "${ROWS[@]}"
fits 60 kernels && { timeout 60 python docs/bench/ep8-gpu/kernels.py --top 16 --rows "ring auto" \
  "ring auto, gather and add in GEMM" 2>&1 | quiet > $OUT/kernels.log; grep "==\|gathered\|scatter_add\|index" $OUT/kernels.log | cut -c1-140; }
fits 50 ab-ep64-16384 && sweep ab-ep64-16384 50 --ep 64 --tokens 16384 --rows "ring auto" "ring auto, gather in GEMM" \
  "ring auto, gather and add in GEMM"
fits 60 ab-ep8-2 && sweep ab-ep8-2 60 --ep 8 --tokens 65536 --rows "${ROWS[@]}"
fits 90 ab-ep64-65536 && sweep ab-ep64-65536 90 --ep 64 --tokens 65536 --rows "${ROWS[@]}"
fits 120 gemm && { timeout 120 python docs/bench/gathered-gemm/gathered_gemm.py --chunks 1 --configs 2 2>&1 | quiet \
  > $OUT/gathered-gemm.txt; grep "scatter\|+\|swiglu" $OUT/gathered-gemm.txt | head -30; }

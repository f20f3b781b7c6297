#!/usr/bin/env bash
# The GEMMs that read their rows at the tokens' indices (issue 24): the kernels' CUDA tests, the kernel against a
# gather and the library GEMM at a hop's shapes (gathered_gemm.py), the ring with and without it (check_ring.py),
# and the forced ring at EP=8 and EP=64, 65536 tokens, 5 interleaved rounds: gather first, gather in GEMM, add in
# GEMM (the sums added by the last GEMMs' epilogue), both.
# Usage: bash docs/bench/gathered-gemm/run.sh OUT [tests] [check] [sweep8] [gemm] [sweep64]   (no parts: all)
set -uo pipefail
OUT=$1; shift
PARTS=${*:-tests check sweep8 gemm sweep64}
source docs/bench/h200-sweep-2/setup.sh
for part in $PARTS; do case $part in
tests) timeout 150 python -m pytest -q -p no:cacheprovider tests/test_gathered_grouped_mm.py \
         tests/test_grouped_weight_grad.py 2>&1 | tail -15 | tee $OUT/tests.txt ;;
gemm) timeout 200 python docs/bench/gathered-gemm/gathered_gemm.py --chunks 4 1 --configs 4 2>&1 | quiet \
        | tee $OUT/gathered-gemm.txt ;;
check) timeout 100 python docs/bench/gathered-gemm/check_ring.py --ep 8 --tokens 8192 2>&1 | quiet | tee $OUT/check-ring.txt ;;
sweep8|sweep64) ep=${part#sweep}
       sweep ab-ep$ep 200 --ep $ep --tokens 65536 --rows "ring auto" "ring auto, gather in GEMM" \
         "ring auto, add in GEMM" "ring auto, gather and add in GEMM" ;;
esac; done

#!/usr/bin/env bash
# The stand-in's link copies by a few thread blocks (standin_group(n, link_stream=True, link_ctas=16)), as NCCL's
# channels: the kernel's CUDA test; whether a copy beside a GEMM overlaps it (concurrency.py: Tensor.copy_, an
# elementwise copy, bounded_copy over 8/16/32 blocks); the 16-block row's copies beside its kernels, by pass and
# place (overlap.py --places); the forced ring on the plain stand-in and on the 16-block link, 5 interleaved rounds.
# Usage: [SHORT=1] bash docs/bench/link-stream/run_ctas.sh OUT   (SHORT=1: the rows at EP=8 65536 only)
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
python -m pytest -q tests/test_bounded_copy.py 2>&1 | tail -2 | tee $OUT/tests.txt
timeout 60 python docs/bench/link-stream/concurrency.py 2>&1 | quiet | tee $OUT/concurrency.txt
timeout 120 python docs/bench/link-stream/overlap.py --places $OUT --rows "ring auto, link stream of 16 CTAs" \
  2>&1 | quiet | grep -v "^\[" | tee $OUT/overlap-ctas-ep8-65536.txt
rm -f $OUT/overlap_*.json
rows=("ring auto" "ring auto, link stream of 16 CTAs")
if [ "${SHORT:-0}" = 1 ]; then
  sweep ctas-ep8 90 --ep 8 --tokens 65536 --no-compile --rows "${rows[@]}"
else
  sweep ctas-ep8 140 --ep 8 --tokens 16384 65536 --no-compile --rows "${rows[@]}"
  sweep ctas-ep64 100 --ep 64 --tokens 65536 --no-compile --rows "${rows[@]}"
fi

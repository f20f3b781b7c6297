#!/usr/bin/env bash
# The stand-in with its transfers on a stream of their own (standin_group(n, link_stream=True)): the numerics
# check and step times on CUDA (check.py), then the forced ring ("ring auto") on both stand-ins beside a2a eager,
# 5 interleaved rounds, at the bar's token counts. Usage: bash docs/bench/link-stream/run.sh OUT
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
timeout 120 python docs/bench/link-stream/check.py --ep 8 --tokens 16384 2>&1 | quiet | tee $OUT/check.txt
rows=("ring auto" "ring auto, link stream" "ring_moe default, link stream")
sweep link-ep8 200 --ep 8 --tokens 16384 32768 65536 131072 --no-compile --rows "${rows[@]}"
sweep link-ep64 200 --ep 64 --tokens 16384 32768 65536 131072 --no-compile --rows "${rows[@]}"

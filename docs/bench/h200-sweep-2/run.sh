#!/usr/bin/env bash
# Issue 24 on one GPU (device tool, torch 2.11), everything one lease allows, most valuable first, each part
# bounded so the later ones still run: the token-count sweep at EP=8 (every row, compiled ones included), at
# EP=64 without the compiled rows (inductor compiles a kept EP=64 region for ~220 s: docs/BENCHMARKS.md, "Kept
# regions at EP=64") and the static backend row at EP=64 where the model runs the ring (no kept compile); then
# owners per hop forced (host_gpu.py), the row-gather host cost, the op census of one step.
# At most 8 files come back from the device: per sweep its sweep.json (calibrate's and bench.sweep's input) and log.
# Usage: bash docs/bench/h200-sweep-2/run.sh "$OUT"
set -uo pipefail
OUT=$1
source "$(dirname "$0")/setup.sh"
sweep sweep-ep8 150 --ep 8
sweep sweep-ep64 110 --ep 64 --no-compile
sweep sweep-ep64-backend 90 --ep 64 --tokens 65536 131072 --rows "relaymoe backend"
{
  echo "== owners per hop forced (host_gpu.py)"
  timeout 90 python docs/bench/h200-hop-host/host_gpu.py --ep 64 --tokens 16384 32768 --repeats 5 --owners 8/8
  timeout 60 python docs/bench/h200-hop-host/host_gpu.py --ep 64 --tokens 65536 --repeats 5 --owners 2/2
  echo "== row gathers (gather_host.py)"; timeout 30 python docs/bench/h200-owners/gather_host.py
  echo "== census, EP=64 16384 (profile_hop.py)"
  mkdir -p /tmp/prof; timeout 45 python docs/bench/h200-hop-host/profile_hop.py /tmp/prof --ep 64 --tokens 16384 > /dev/null \
    && head -40 /tmp/prof/census-*.txt
} 2>&1 | quiet | tee $OUT/host.txt

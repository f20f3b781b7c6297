#!/usr/bin/env bash
# Issue 24 on one GPU (device tool, torch 2.11), everything one lease allows, most valuable first, each part
# bounded so the later ones still run: owners per hop forced (host_gpu.py), the token-count sweep at EP=8 (every
# row, compiled ones included) and at EP=64 without the compiled rows (inductor compiles a kept EP=64 region
# for ~220 s: docs/BENCHMARKS.md, "Kept regions at EP=64"), the row-gather host cost.
# Usage: bash docs/bench/h200-sweep-2/run.sh "$OUT"
set -uo pipefail
OUT=$1
python -m pip install -q --no-deps --no-build-isolation --no-index -e . > /dev/null 2>&1
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee $OUT/env.txt
git log -1 --format=%H 2>/dev/null | tee -a $OUT/env.txt
quiet() { grep --line-buffered -v "Warn\|warn_once\|USDT"; }
export PYTHONUNBUFFERED=1
{
  timeout 170 python docs/bench/h200-hop-host/host_gpu.py --ep 64 --tokens 16384 32768 --repeats 5 --owners 8/8 4/4
  timeout 100 python docs/bench/h200-hop-host/host_gpu.py --ep 64 8 --tokens 65536 --repeats 5 --owners 2/2 4/2
} 2>&1 | quiet | tee $OUT/owners.txt
timeout 150 python -m relay_compile.bench --preset sweep --ep 8 --repeats 5 --warmup 2 --out $OUT/sweep-ep8 2>&1 \
  | quiet > $OUT/sweep-ep8.log; grep "|" $OUT/sweep-ep8.log | cut -c1-130
timeout 110 python -m relay_compile.bench --preset sweep --ep 64 --no-compile --repeats 5 --warmup 2 \
  --out $OUT/sweep-ep64 2>&1 | quiet > $OUT/sweep-ep64.log; grep "|" $OUT/sweep-ep64.log | cut -c1-130
timeout 40 python docs/bench/h200-owners/gather_host.py 2>&1 | quiet | tee $OUT/gather_host.txt

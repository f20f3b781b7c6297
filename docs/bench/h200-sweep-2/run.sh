#!/usr/bin/env bash
# Issue 24 on one GPU (device tool, torch 2.11), everything one lease allows, most valuable first, each part
# bounded so the later ones still run: owners per hop forced (host_gpu.py), the token-count sweep at EP=8 (every
# row, compiled ones included) and at EP=64 without the compiled rows (inductor compiles a kept EP=64 region
# for ~220 s: docs/BENCHMARKS.md, "Kept regions at EP=64"), the row-gather host cost, the op census of one step.
# At most 8 files come back from the device: per sweep its sweep.json (calibrate's input), results.md and log.
# Usage: bash docs/bench/h200-sweep-2/run.sh "$OUT"
set -uo pipefail
OUT=$1
python -m pip install -q --no-deps --no-build-isolation --no-index -e . > /dev/null 2>&1
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee $OUT/env.txt
git log -1 --format=%H 2>/dev/null | tee -a $OUT/env.txt
quiet() { grep --line-buffered -v "Warn\|warn_once\|USDT"; }
export PYTHONUNBUFFERED=1
{
  echo "== owners per hop forced (host_gpu.py)"
  timeout 170 python docs/bench/h200-hop-host/host_gpu.py --ep 64 --tokens 16384 32768 --repeats 5 --owners 8/8 4/4
  timeout 100 python docs/bench/h200-hop-host/host_gpu.py --ep 64 8 --tokens 65536 --repeats 5 --owners 2/2 4/2
} 2>&1 | quiet | tee $OUT/host.txt
sweep() {  # EP, extra args
  local ep=$1; shift
  timeout $TLIM python -m relay_compile.bench --preset sweep --ep $ep --repeats 5 --warmup 2 --out /tmp/sweep-ep$ep "$@" \
    2>&1 | quiet > $OUT/sweep-ep$ep.log
  cp /tmp/sweep-ep$ep/sweep.json $OUT/sweep-ep$ep.json; cp /tmp/sweep-ep$ep/results.md $OUT/sweep-ep$ep.md
  grep "|" $OUT/sweep-ep$ep.log | cut -c1-130
}
TLIM=150 sweep 8
TLIM=110 sweep 64 --no-compile
{
  echo "== row gathers (gather_host.py)"; timeout 40 python docs/bench/h200-owners/gather_host.py
  echo "== census, EP=64 16384 (profile_hop.py)"
  mkdir -p /tmp/prof; timeout 60 python docs/bench/h200-hop-host/profile_hop.py /tmp/prof --ep 64 --tokens 16384 > /dev/null && head -40 /tmp/prof/census-*.txt
} 2>&1 | quiet | tee -a $OUT/host.txt

#!/usr/bin/env bash
# Owners per hop with the first stack gathered (issue 24, deliverables 3-4), one GPU (device tool), torch 2.11.
# Usage: bash docs/bench/h200-owners/run.sh "$OUT". With ab_old/relay_compile present (the code before the
# gather, commit 2e74dc2, untracked), its default rows run beside this code's, alternating processes.
set -uo pipefail
OUT=$1
python -m pip install -q --no-deps --no-build-isolation --no-index -e . > /dev/null 2>&1
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee $OUT/env.txt
hg() { PYTHONUNBUFFERED=1 python docs/bench/h200-hop-host/host_gpu.py "$@" 2>&1 | grep -v "Warn\|warn_once\|USDT"; }
{
  hg --ep 64 --tokens 16384 32768 --repeats 7 --owners 4/4 8/4 8/8 4/8
  hg --ep 64 --tokens 65536 --repeats 5 --owners 2/2 4/2
  hg --ep 8 --tokens 16384 32768 --repeats 5 --owners 2/2 4/4
} | tee $OUT/owners.txt
if [ -d ab_old/relay_compile ]; then
  PYTHONPATH=$PWD/ab_old python -c "import relay_compile; print(\"ab_old imports\", relay_compile.__file__)"
  for round in 1 2; do
    echo "== round $round: before the gather (2e74dc2)"; PYTHONPATH=$PWD/ab_old hg --ep 64 --tokens 16384 32768 65536 --repeats 5
    echo "== round $round: gathered first stack"; hg --ep 64 --tokens 16384 32768 65536 --repeats 5
  done 2>&1 | tee $OUT/ab.txt
fi
python docs/bench/h200-owners/gather_host.py 2>&1 | tee $OUT/gather_host.txt
python docs/bench/h200-hop-host/profile_hop.py $OUT --ep 64 --tokens 16384 2>&1 | grep -v "Warn\|warn_once\|USDT" | head -60

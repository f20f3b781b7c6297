#!/usr/bin/env bash
# Session 5 host-cost probes (device tool, carry .whl with py-spy): bash docs/bench/h200-hostcost/run.sh

source docs/bench/device_env.sh
export PATH=/tmp/site/bin:$PATH  # py-spy
[ -n "${GATHER:-}" ] && python docs/bench/h200-hostcost/gather_ab.py 2>&1 | grep -v Warn
[ -n "${SPY:-}" ] && timeout 200 py-spy record --nonblocking -r 250 -f raw -o /tmp/spy_gpu.txt -- python docs/bench/h200-hostcost/steps.py 2>&1 | grep -v Warn | tail -1
[ -n "${SPY:-}" ] && python docs/bench/h200-hostcost/spy_summary.py /tmp/spy_gpu.txt --top 70 > $OUT/spy_gpu_summary.txt
python docs/bench/h200-hostcost/op_census.py 2>&1 | grep -v Warn | tee $OUT/op_census.txt | head -45

# A/B against a baseline tree carried as .ab_old (ignored; its relay_compile first on the path), alternating
if [ -d .ab_old ]; then
  for i in 1 2 3; do
    echo -n "base: "; PYTHONPATH=.ab_old:/tmp/site python docs/bench/h200-hostcost/steps.py 2>&1 | grep -v Warn | tail -1
    echo -n "new:  "; python docs/bench/h200-hostcost/steps.py 2>&1 | grep -v Warn | tail -1
  done
fi

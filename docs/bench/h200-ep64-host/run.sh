#!/usr/bin/env bash
# Issue 10 on one H200 (torch 2.11), session 5: the EP=64 ring's host time after the transport and stand-in cuts.
# Usage (device tool, carry .whl, .whl-titan, and for "ab" a baseline tree as .ab_old, ignored by git:
#   mkdir .ab_old && git archive 6d65bb3 relay_compile | tar -x -C .ab_old):
#   bash docs/bench/h200-ep64-host/run.sh "$OUT" [parts...]
# Parts (default all): tests ab census rows titan. Everything lands in $OUT/raw.tar.gz and $OUT/log.txt.
set -uo pipefail
OUT=$1; shift
PARTS=${*:-tests ab census rows titan}
RAW=/tmp/raw; mkdir -p $RAW
source docs/bench/device_env.sh
for part in $PARTS; do
  echo "== $part $(date +%T)"
  case $part in
    tests) python -m pytest -q tests/test_experts.py tests/runtime/test_transport.py tests/test_scatter_add_rows.py \
             tests/runtime/test_row_sum.py tests/bench/test_standin_group.py 2>&1 | tail -2 ;;
    ab) # ring_moe direct at EP=64, the baseline tree (.ab_old: session 4's final relay_compile) and this one
        # alternating, one process each (docs/bench/h200-hostcost/steps.py: medians of 60 steps)
        for i in 1 2 3; do
          echo -n "base: "; PYTHONPATH=.ab_old:/tmp/site python docs/bench/h200-hostcost/steps.py 2>&1 | grep -v Warn | tail -1
          echo -n "new:  "; python docs/bench/h200-hostcost/steps.py 2>&1 | grep -v Warn | tail -1
        done | tee $RAW/ab.txt ;;
    census) python docs/bench/h200-hostcost/op_census.py 2>&1 | grep -v Warn | tee $RAW/op_census.txt | head -12 ;;
    rows) python docs/bench/h200-memory/rows.py $RAW --ep 64 8 --bounds --backend --interleave 2>&1 | grep -v Warning \
            | grep -v "^\[" ;;
    titan) mkdir -p $RAW/titan-interleaved
           python docs/bench/h200-torchtitan/titan_rows.py $RAW/titan-interleaved --interleave --compile-ep 64 \
             > $RAW/titan_interleaved_log.txt 2>&1
           tail -22 $RAW/titan_interleaved_log.txt | grep -v "Warn\|warn_once" ;;
  esac
done
tar czf $OUT/raw.tar.gz -C $RAW .

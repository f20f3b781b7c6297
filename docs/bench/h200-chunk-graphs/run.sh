#!/usr/bin/env bash
# Issue 10 on one H200 (torch 2.11), session 6: chunk graphs (runtime/chunk_graphs.py).
# Usage (device tool, carry .whl and .whl-titan): bash docs/bench/h200-chunk-graphs/run.sh "$OUT" [parts...]
# Parts (default all): tests rows64 rows8 host spy titan. Output in $OUT/log.txt and $OUT/raw.tar.gz.
# "host": EP=64 ring_moe steps, chunk graphs off and on in alternating processes (host and wall ms per step,
# medians of 60: docs/bench/h200-hostcost/steps.py); "spy": a py-spy profile of the steps with chunk graphs.
set -uo pipefail
OUT=$1; shift
PARTS=${*:-tests rows64 rows8 host spy titan}
RAW=/tmp/raw; mkdir -p $RAW
source docs/bench/device_env.sh
for part in $PARTS; do
  echo "== $part $(date +%T)"
  case $part in
    tests) python -m pytest -q tests/runtime/test_chunk_graphs.py tests/test_experts.py \
             tests/runtime/test_row_sum.py tests/bench/test_standin_group.py 2>&1 | tail -3 ;;
    rows64) mkdir -p $RAW/rows64 && python docs/bench/h200-chunk-graphs/rows.py $RAW/rows64 --ep 64 2>&1 \
              | grep -v "Warn\|warn_once\|^\[" ;;
    rows8) mkdir -p $RAW/rows8 && python docs/bench/h200-chunk-graphs/rows.py $RAW/rows8 --ep 8 2>&1 \
              | grep -v "Warn\|warn_once\|^\[" ;;
    host) for i in 1 2 3; do
            echo -n "off: "; python docs/bench/h200-hostcost/steps.py 2>&1 | grep -v Warn | tail -1
            echo -n "on:  "; python docs/bench/h200-hostcost/steps.py --chunk-graphs 2>&1 | grep -v Warn | tail -1
          done | tee $RAW/host_ab.txt ;;
    spy) export PATH=/tmp/site/bin:$PATH
         timeout 200 py-spy record --nonblocking -r 250 -f raw -o /tmp/spy.txt -- \
           python docs/bench/h200-hostcost/steps.py --chunk-graphs 2>&1 | grep -v Warn | tail -1
         python docs/bench/h200-hostcost/spy_summary.py /tmp/spy.txt --top 60 > $RAW/spy_graphs_summary.txt
         head -45 $RAW/spy_graphs_summary.txt ;;
    titan) mkdir -p $RAW/titan && python docs/bench/h200-torchtitan/titan_rows.py $RAW/titan --interleave \
             > $RAW/titan_log.txt 2>&1; tail -22 $RAW/titan_log.txt | grep -v "Warn\|warn_once" ;;
  esac
done
tar czf $OUT/raw.tar.gz -C $RAW .

#!/usr/bin/env bash
# Issue 10 on one H200 (torch 2.11), session 7: the grouped forward (two owners per hop at EP=64) and backward
# chunks padded to equal groups (batched GEMMs).
# Usage (device tool, carry .whl, .whl-titan, and for "ab" the baseline tree as .ab_old, ignored by git:
#   rm -rf .ab_old && mkdir .ab_old && git archive 0e7e4c2 relay_compile | tar -x -C .ab_old):
#   bash docs/bench/h200-grouped-forward/run.sh "$OUT" [parts...]
# Parts (default all): tests ab rows titan. Output: $OUT/log.txt (what the command prints) and $OUT/raw.tar.gz.
set -uo pipefail
OUT=$1; shift
PARTS=${*:-tests ab rows titan}
RAW=/tmp/raw; mkdir -p $RAW; n=0
source docs/bench/device_env.sh
for part in $PARTS; do
  echo "== $part $(date +%T)"
  case $part in
    tests) python -m pytest -q tests/bench/test_standin_group.py tests/test_experts.py tests/runtime/test_transport.py \
             tests/test_routing.py tests/runtime/test_equal_groups.py tests/runtime/test_chunk_graphs.py 2>&1 | tail -2
           python docs/bench/h200-grouped-forward/numerics.py 2>&1 | grep -v Warn ;;
    ab) n=$((n + 1)); for i in 1 2 3; do  # baseline (.ab_old) and this tree alternating, one process each, medians of 60 steps
          echo -n "base: "; PYTHONPATH=.ab_old:/tmp/site python docs/bench/h200-grouped-forward/steps.py 2>&1 \
            | grep -v Warn | tail -1
          echo -n "new:  "; python docs/bench/h200-grouped-forward/steps.py 2>&1 | grep -v Warn | tail -1
          [ -f relay_compile/runtime/equal_groups.py ] && { echo -n "new, no equal groups: "
            python docs/bench/h200-grouped-forward/steps.py --no-equal-groups 2>&1 | grep -v Warn | tail -1; }
        done | tee $RAW/ab$n.txt ;;
    rows) n=$((n + 1)); mkdir -p $RAW/rows$n  # "rows" may be asked more than once: rows1, rows2, ...
          python docs/bench/h200-grouped-forward/rows.py $RAW/rows$n --ep 64 8 2>&1 \
            | grep -v "Warn\|warn_once\|^\[" ;;
    titan) mkdir -p $RAW/titan && python docs/bench/h200-torchtitan/titan_rows.py $RAW/titan --interleave \
             > $RAW/titan_log.txt 2>&1; tail -22 $RAW/titan_log.txt | grep -v "Warn\|warn_once" ;;
  esac
done
tar czf $OUT/raw.tar.gz -C $RAW .

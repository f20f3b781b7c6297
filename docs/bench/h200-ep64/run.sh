#!/usr/bin/env bash
# Issues 10/12 on one H200 (torch 2.11), session 4: EP=64 after RowSum and one-span transfers.
# Usage (device tool, carry .whl and .whl-titan): bash docs/bench/h200-ep64/run.sh "$OUT" [parts...]
# Parts (default all): tests spread rows numerics titan train; final (the last run: CUDA tests of the merged
# biased experts, and the rows and torchtitan rows with their steps interleaved). Everything lands in $OUT/raw.tar.gz and $OUT/log.txt.
set -uo pipefail
OUT=$1; shift
PARTS=${*:-tests spread rows numerics titan train final}
RAW=/tmp/raw; mkdir -p $RAW
source docs/bench/device_env.sh
for part in $PARTS; do
  echo "== $part $(date +%T)"
  case $part in
    tests) python -m pytest -q tests/runtime/test_row_sum.py tests/test_scatter_add_rows.py tests/runtime/test_transport.py \
             tests/bench/test_standin_group.py 2>&1 | tail -3 ;;
    spread) python docs/bench/h200-hostcost/step_spread.py $RAW 2>&1 | grep -v Warn
            echo "-- OMP_NUM_THREADS=1"
            OMP_NUM_THREADS=1 python docs/bench/h200-hostcost/step_spread.py $RAW --tag omp1 2>&1 | grep -v Warn ;;
    rows) python docs/bench/h200-memory/rows.py $RAW --ep 64 8 --bounds --backend 2>&1 | grep -v Warning | grep -v "^\[" ;;
    numerics) python -m relay_compile.bench --preset numerics --device cuda --ep 8 64 --tokens 65536 --out $RAW/numerics \
                2>&1 | tail -2; sed -n '/bf16 numerics/,$p' $RAW/numerics/results.md ;;
    titan) mkdir -p $RAW/titan; python docs/bench/h200-torchtitan/titan_rows.py $RAW/titan --rounds 2 > $RAW/titan_log.txt 2>&1;
           tail -25 $RAW/titan_log.txt | grep -v "Warn\|warn_once" ;;
    train) TRAIN="--device cuda --simulate-ep 8 --dtype bfloat16 --steps 300 --hidden 512 --heads 8 --layers 4 --ffn 384
             --experts 64 --top-k 8 --batch 8 --seq-len 512 --vocab 4096 --plot= --seed 0"
           for s in 0 1 2 3; do
             timeout 200 python examples/train_moe.py $TRAIN --data-seed $s --backend relaymoe \
               --report-json "$RAW/train_data${s}_relaymoe.json" 2>&1 | grep -v Warning | awk '/^ *(299) |result|Error|error/'
           done ;;
    final) python -m pytest -q tests/test_experts.py tests/runtime/test_row_sum.py 2>&1 | tail -2
           python docs/bench/h200-memory/rows.py $RAW --ep 64 8 --bounds --backend --interleave 2>&1 | grep -v Warning \
             | grep -v "^\["
           mkdir -p $RAW/titan-interleaved; python docs/bench/h200-torchtitan/titan_rows.py $RAW/titan-interleaved \
             --interleave --compile-ep 64 > $RAW/titan_interleaved_log.txt 2>&1
           tail -22 $RAW/titan_interleaved_log.txt | grep -v "Warn\|warn_once" ;;
  esac
done
tar czf $OUT/raw.tar.gz -C $RAW .

#!/usr/bin/env bash
# Issue 12 on one H200 (torch 2.11): numerics table, time/peak rows, and bf16 training curves (simulated EP=8).
# Usage (device tool): bash docs/bench/h200-numerics/run.sh "$OUT"
set -uo pipefail
OUT=$1
python -m pip install -q --no-deps --no-build-isolation --no-index -e . > /dev/null
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -m unittest tests.test_scatter_add_rows tests.test_experts 2>&1 | tail -3
python -m relay_compile.bench --preset numerics --device cuda --ep 8 64 --tokens 65536 --out "$OUT/numerics" 2>&1 | tail -3
sed -n '/bf16 numerics/,$p' "$OUT/numerics/results.md"
python docs/bench/h200-numerics/rows.py "$OUT" 2>&1 | grep -v Warning
TRAIN="--device cuda --simulate-ep 8 --dtype bfloat16 --steps 300 --hidden 512 --heads 8 --layers 4 --ffn 384
       --experts 64 --top-k 8 --batch 8 --seq-len 512 --vocab 4096 --plot= --seed 0"
# (a) eager a2a vs (b) relaymoe, on two data orders (the run-to-run noise); then (b) = a2a under inductor, the
# compiler alone (relaymoe's inner compiler is inductor too).
for run in "0 relaymoe" "1 relaymoe" "0 inductor"; do
  set -- $run
  timeout 240 python examples/train_moe.py $TRAIN --data-seed $1 --backend $2 --report-json "$OUT/train_data$1_$2.json" \
    2>&1 | grep -v Warning | awk 'NR <= 4 || /^ *(0|1|2|50|100|150|200|250|299) / || /result|peak|rewritten|Error|error/'
done

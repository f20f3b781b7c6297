#!/bin/bash
# raw-6 (issue 28): the aot_eager fix checked, the training curve with aot_eager, the numerics preset every rank
# real, and the largest skew each row fits in 6 GiB per rank. Two device calls (each under 600 s):
#   bash docs/bench/h200-real-ranks/raw6.sh "$OUT" a    # aot diag + 60-step training with aot_eager
#   bash docs/bench/h200-real-ranks/raw6.sh "$OUT" b    # numerics preset + skew search
OUT=${1:-/tmp/out}; PART=${2:-a}; mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
export OMP_NUM_THREADS=4 PYTHONPATH=$PWD
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/gpu_$PART.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT/gpu_$PART.txt"
t0=$SECONDS
if [ "$PART" = a ]; then
  bash docs/bench/h200-aot-eager/run.sh "$OUT/aot"; echo "[aot diag $((SECONDS-t0)) s]"
  bash docs/bench/h200-real-ranks/train_curve.sh "$OUT" aot_eager; echo "[train $((SECONDS-t0)) s]"
else
  timeout 330 python -m relay_compile.bench --preset numerics --device cuda --ep 2 4 8 --tokens 16384 \
    --out "$OUT/numerics" 2>&1 | grep -v DEBUG > "$OUT/numerics.txt"; echo "numerics rc=$? [$((SECONDS-t0)) s]"
  tail -60 "$OUT/numerics.txt"
  timeout $((560-SECONDS+t0)) python -m relay_compile.bench.real_ranks search --ep 8 --tokens 16384 \
    --budget-gib 6 --search hot_rank --probes 5 2>&1 | grep -v DEBUG | tee "$OUT/search_hot_rank.txt"
  echo "search rc=$? [$((SECONDS-t0)) s]"
fi

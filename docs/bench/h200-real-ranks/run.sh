#!/bin/bash
# Every-rank-real EP on one H200 (issue 28). Usage (device tool): bash docs/bench/h200-real-ranks/run.sh "$OUT"
set -x
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python -c "import torch; print(torch.__version__)" | tee -a "$OUT/gpu.txt"
export OMP_NUM_THREADS=4 PYTHONPATH=.
timeout 150 python docs/bench/h200-real-ranks/cuda_check.py 2>&1 | grep -v DEBUG | tee "$OUT/cuda_check.txt"
timeout 220 python -m relay_compile.bench.real_ranks numerics --ep 2 4 8 --tokens 16384 \
  --routers qwen3 hot_expert:inf 2>&1 | grep -v DEBUG | tee "$OUT/numerics.txt"
timeout 200 python -m relay_compile.bench.real_ranks imbalance --ep 8 --tokens 16384 --budget-gib 6 \
  --routers qwen3 hot_expert:inf hot_rank:0.25 hot_rank:0.5 zipf:1.0 zipf:1.5:uneven 2>&1 | grep -v DEBUG \
  | tee "$OUT/imbalance.txt"
# raw-3: uneven tokens and a hot rank in the numerics; the training example every rank real, 60 steps.
timeout 150 python -m relay_compile.bench.real_ranks numerics --ep 8 --tokens 16384 \
  --routers qwen3:0:uneven hot_rank:0.5 2>&1 | grep -v DEBUG | tee "$OUT/numerics_uneven.txt"
(cd examples && timeout 400 python train_moe.py --rank-threads 8 --device cuda --dtype float32 --steps 60 \
  --routing token --inner-compiler aot_eager --hidden 256 --ffn 128 --experts 32 --top-k 4 --batch 4 \
  --seq-len 256 --layers 2 --heads 4 --plot "" --report-json "$OUT/train.json") 2>&1 | grep -v DEBUG \
  | tee "$OUT/train.txt" | tail -40

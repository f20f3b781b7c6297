#!/usr/bin/env bash
# Issue 24 on one H200 (torch 2.11): the all-to-all path's numerics on CUDA, then the token-count sweep with the
# cost model's predictions (python -m relay_compile.bench --preset sweep), one EP size per call.
# Usage (device tool): bash docs/bench/h200-time-model/run.sh "$OUT" EP [EP ...]
set -uo pipefail
OUT=$1; shift
EPS=${*:-8 64}
python -m pip install -q --no-deps --no-build-isolation --no-index -e . > /dev/null 2>&1
python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
python docs/bench/h200-time-model/check.py --ep $EPS 2>&1 | grep -v Warn
for ep in $EPS; do
  python -m relay_compile.bench --preset sweep --ep $ep --repeats 5 --warmup 2 --out $OUT/sweep-ep$ep 2>&1 \
    | grep -v "Warn\|warn_once\|USDT" | tee $OUT/sweep-ep$ep.log | tail -45
done

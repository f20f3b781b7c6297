#!/usr/bin/env bash
# Issue 24 on one H200 (torch 2.11): the all-to-all path's numerics on CUDA, the token-count sweep with the cost
# model's predictions (python -m relay_compile.bench --preset sweep), one EP size after the other; with "full",
# the full-model bench (time-bounded searches).
# Usage (device tool): bash docs/bench/h200-time-model/run.sh "$OUT" [EP ...] [full]
set -uo pipefail
OUT=$1; shift
ARGS=${*:-8 64}
EPS=$(echo $ARGS | tr ' ' '\n' | grep -v full | tr '\n' ' ')
python -m pip install -q --no-deps --no-build-isolation --no-index -e . > /dev/null 2>&1
python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
[ -n "$EPS" ] && python docs/bench/h200-time-model/check.py --ep $EPS 2>&1 | grep -v Warn
for ep in $EPS; do
  python -m relay_compile.bench --preset sweep --ep $ep --repeats 5 --warmup 2 --out $OUT/sweep-ep$ep 2>&1 \
    | grep -v "Warn\|warn_once\|USDT" > $OUT/sweep-ep$ep.log; grep "|" $OUT/sweep-ep$ep.log | cut -c1-140
done
if echo $ARGS | grep -q full; then
  python -m relay_compile.bench.full_model --preset h200 --memory-gib 80 --repeats 5 --time-budget 240 \
    --out $OUT/full-model 2>&1 | grep -v "Warn\|warn_once\|USDT" > $OUT/full-model.log; tail -40 $OUT/full-model.log
fi

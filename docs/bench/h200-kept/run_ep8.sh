#!/usr/bin/env bash
# Issue 24: the backend's default row (inner inductor) where it keeps the all-to-all at EP=8, beside a2a eager.
# Usage (device tool): bash docs/bench/h200-kept/run_ep8.sh "$OUT" [TOKENS ...]
set -uo pipefail
OUT=$1; shift
python -m pip install -q --no-deps --no-build-isolation --no-index -e . > /dev/null 2>&1
python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
for t in ${*:-4096 8192 16384}; do
  python docs/bench/h200-kept/diag.py --ep 8 --tokens $t --repeats 9 --deadline 400 \
    --rows eager relaymoe/inductor 2>&1 | grep -v "Warn\|warn_once\|USDT" | tee $OUT/ep8-$t.txt
done

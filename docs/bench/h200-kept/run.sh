#!/usr/bin/env bash
# Issue 24, the kept region at EP=64 (device tool): bash docs/bench/h200-kept/run.sh "$OUT"
set -uo pipefail
OUT=$1; shift
python -m pip install -q --no-deps --no-build-isolation --no-index -e . > /dev/null 2>&1
python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
python docs/bench/h200-kept/diag.py "$@" 2>&1 | grep -v "Warn\|warn_once\|USDT" | tee $OUT/diag.txt

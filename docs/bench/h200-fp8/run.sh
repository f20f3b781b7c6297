#!/usr/bin/env bash
# Issue 27, FP8 hops on one H200. Usage (device tool, carrying te/): bash docs/bench/h200-fp8/run.sh "$OUT"
set -uo pipefail
OUT=$1
python -m pip install -q --no-deps --no-build-isolation --no-index -e . > /dev/null 2>&1
bash te/install.sh > "$OUT/te_install.txt" 2>&1
source /tmp/te/env.sh
PYTHONUNBUFFERED=1 python docs/bench/h200-fp8/fp8_ring.py "${@:2}" 2>&1 \
  | grep --line-buffered -v "Warn\|warn_once\|USDT\|warnings.warn" | tee "$OUT/fp8_ring.txt"

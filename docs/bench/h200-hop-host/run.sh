#!/usr/bin/env bash
# Issue 24's cheaper hop on one H200 (torch 2.11). Usage (device tool): bash docs/bench/h200-hop-host/run.sh "$OUT"
set -uo pipefail
OUT=$1
python -m pip install -q --no-deps --no-build-isolation --no-index -e . > /dev/null 2>&1
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python -m pytest -q tests/test_grouped_weight_grad.py tests/test_experts.py tests/test_scatter_add_rows.py 2>&1 | tail -3
PYTHONUNBUFFERED=1 python docs/bench/h200-hop-host/kernel_ab.py "${@:2}" 2>&1 | grep -v "Warn\|warn_once\|USDT" | tee $OUT/kernel_ab.txt

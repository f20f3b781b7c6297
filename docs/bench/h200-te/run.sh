#!/usr/bin/env bash
# Issue 27 on one H200 (torch 2.11): a Megatron-style MoE layer with real TE GroupedLinear experts, eager against
# backend="relaymoe". Usage (device tool, carrying te/ = ../shared/te): bash docs/bench/h200-te/run.sh "$OUT"
set -uo pipefail
OUT=$1
python -m pip install -q --no-deps --no-build-isolation --no-index -e . > /dev/null 2>&1
bash te/install.sh > "$OUT/te_install.txt" 2>&1
source /tmp/te/env.sh
python -c "import torch, transformer_engine.pytorch as te; print('torch', torch.__version__, 'te', te.__version__, torch.cuda.get_device_name())" 2>&1 | tail -1
for T in ${TOKENS:-65536}; do
  PYTHONUNBUFFERED=1 python docs/bench/h200-te/te_layer.py --tokens "$T" --ep 8 --out "$OUT/t$T" "${@:2}" 2>&1 \
    | grep --line-buffered -v "Warn\|warn_once\|USDT\|warnings.warn" | tee "$OUT/te_layer_t$T.txt" | tail -25
done

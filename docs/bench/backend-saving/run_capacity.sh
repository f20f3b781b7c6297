#!/usr/bin/env bash
# Issue 24's capacity bars on one GPU (relaymoe's best row >= 3x a2a eager's longest tokens per rank, >= 2x the best
# a2a row's): a2a eager, a2a + full AC and relaymoe + budget (the backend with the partitioner's activation budget
# chosen per length), searched within a time budget. The cap: 76 GiB on an H100, 80 GiB elsewhere (as issue 14).
# Usage: bash docs/bench/backend-saving/run_capacity.sh "$OUT"
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
cap=$(python -c 'import torch; print(76 if "H100" in torch.cuda.get_device_name() else 80)')
timeout 560 python -m relay_compile.bench.full_model --preset h200 --memory-gib $cap --out /tmp/fm-cap \
  --rows "a2a eager" "a2a + full AC" "relaymoe + budget" --time-budget 440 2>&1 | quiet | tee $OUT/capacity.log | tail -40
cp /tmp/fm-cap/results.json /tmp/fm-cap/results.md $OUT/ 2>/dev/null

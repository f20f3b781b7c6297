#!/usr/bin/env bash
# One call of the sixth session (2026-12-07): on an H200, the bar sweep (h200-check/run.sh) and the 16-block
# link at high priority without its profile; on an H100, run_priority.sh whole. Then whether this torch's
# ProcessGroupNCCL shows its options' stream priority to Python.
# Usage: bash docs/bench/link-stream/run_device6.sh OUT
set -uo pipefail
OUT=$1
mkdir -p $OUT/check $OUT/priority
if python -c "import torch, sys; sys.exit(0 if 'H200' in torch.cuda.get_device_name() else 1)"; then
  bash docs/bench/h200-check/run.sh $OUT/check 2>&1 | grep "|" | cut -c1-160 | tail -40
  source docs/bench/h200-sweep-2/setup.sh
  OUT=$OUT/priority
  timeout 90 python docs/bench/link-stream/concurrency.py 2>&1 | quiet | tee $OUT/concurrency.txt
  sweep priority-ep8 120 --ep 8 --tokens 65536 --no-compile --rows "ring auto" "ring auto, link stream of 16 CTAs" \
    "ring auto, link stream of 16 CTAs, high priority"
else
  bash docs/bench/link-stream/run_priority.sh $OUT/priority
fi
python -c "
import torch.distributed as d
pg = getattr(d, 'ProcessGroupNCCL', None)
print('ProcessGroupNCCL:', pg is not None, '| options property:', hasattr(pg, 'options'),
      '| Options fields:', [a for a in dir(getattr(pg, 'Options', object)) if 'prior' in a])
" 2>&1 | tee $OUT/nccl-options.txt

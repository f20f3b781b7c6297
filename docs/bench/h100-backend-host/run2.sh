#!/usr/bin/env bash
# The backend row beside a2a eager and the eager rings, in the sweep's harness (interleaved rounds), at EP=64 16384
# and 32768 and EP=8 16384, after host_diag.py (run.sh) found the backend's ring issuing its step as fast as the
# eager ring's. Usage: bash docs/bench/h100-backend-host/run2.sh "$OUT"
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
for cfg in "64 16384" "64 32768" "8 16384"; do
  set -- $cfg
  timeout 170 python -m relay_compile.bench --preset sweep --repeats 5 --warmup 2 --out /tmp/s$1-$2 --ep $1 \
    --tokens $2 --rows "relaymoe backend" "ring_moe default" "ring expert" "ring expert saved" 2>&1 | quiet \
    > $OUT/backend-ep$1-$2.log
  grep "|" $OUT/backend-ep$1-$2.log | cut -c1-150; cp /tmp/s$1-$2/sweep.json $OUT/backend-ep$1-$2.json
done

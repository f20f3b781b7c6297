#!/usr/bin/env bash
# Kept regions with their split sizes read as tensors (passes.split_reads, option split_reads) against the same
# graph with the 2N reads Dynamo traced ("/traced"), beside a2a eager, interleaved fwd+bwd, in one process per
# shape (docs/bench/h200-kept/diag.py: first-call seconds, median ms, ratio, GPU kernel ms, peak MiB); then the
# backend row of the sweep at EP=64 4096 and 8192, where the cost model keeps the all-to-all (bar: <= 1.0x).
# Usage: bash docs/bench/split-reads/run.sh OUT
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
diag() {
  local limit=$1; shift
  # --deadline past the limit: diag skips inductor rows 200 s before it (the traced graph's compile at EP=64).
  timeout $limit python docs/bench/h200-kept/diag.py --deadline $((limit + 200)) --repeats 9 "$@" 2>&1 | quiet \
    | grep -v "^\[" | tee -a $OUT/diag.log | grep "|\|first call\|EP=\|skipped"
}
diag 130 --ep 64 --tokens 8192 --rows eager relaymoe/inductor relaymoe/aot_eager relaymoe/aot_eager/traced
diag 75 --ep 8 --tokens 4096 --rows eager relaymoe/inductor relaymoe/inductor/traced
sweep backend-ep64 140 --ep 64 --tokens 4096 8192 --rows "relaymoe backend"

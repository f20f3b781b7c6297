#!/usr/bin/env bash
# The sweep (no compiled rows) after the backward's agreement moved beside the compute stream: the data to refit
# the device's time-model constants (python -m relay_compile.bench.calibrate OUT/sweep-ep8.json OUT/sweep-ep64.json).
# Usage: bash docs/bench/h100-backward-agreement/run2.sh "$OUT"
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
sweep sweep-ep8 150 --ep 8 --no-compile
sweep sweep-ep64 150 --ep 64 --no-compile

#!/usr/bin/env bash
# The sweep again (EP=8 every row but the compiled ones, EP=64 likewise), predicted by the constants of the device
# it lands on: on an H200 the data for refitting cost_model.H200; on an H100 an independent check of
# cost_model.H100 (fitted to raw-1-h100).
# Usage: bash docs/bench/h200-sweep-2/run4.sh "$OUT"
set -uo pipefail
OUT=$1
source "$(dirname "$0")/setup.sh"
sweep sweep-ep8 120 --ep 8 --no-compile
sweep sweep-ep64 120 --ep 64 --no-compile

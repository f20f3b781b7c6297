#!/usr/bin/env bash
# The sweep without compiled rows (EP 8 and 64, 4096-131072 tokens per rank, a2a eager, ring_moe default, the
# rings recomputing / saving / token-routed, 5 interleaved rounds: the data a refit of the device's constants
# reads), then the backend rows (run_backend.sh). Check or refit the constants here with
# python -m relay_compile.bench.calibrate [--check NAME | --start NAME] OUT/sweep-ep8.json OUT/sweep-ep64.json.
# Usage: bash docs/bench/backend-saving/run.sh "$OUT"
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
sweep sweep-ep8 150 --ep 8 --no-compile
sweep sweep-ep64 150 --ep 64 --no-compile
bash docs/bench/backend-saving/run_backend.sh "$OUT"

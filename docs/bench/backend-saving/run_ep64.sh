#!/usr/bin/env bash
# The backend row at EP=64, 16384 tokens per rank after the H200 refit (the ring, saving; the constants of
# 2026-12-02 kept the all-to-all there), beside a2a eager and the saved ring.
# Usage: bash docs/bench/backend-saving/run_ep64.sh "$OUT"
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
sweep backend-ep64-16384 110 --ep 64 --tokens 16384 --rows "relaymoe backend" "ring expert saved"
python - "$OUT" <<'PY'
import json, sys
d = json.load(open(sys.argv[1] + "/backend-ep64-16384.json"))
for dec in d["decisions"]:
    print(dec["execution"], "saves" if dec["saves_projections"] else "no save", dec["reason"], "| a call:", dec["call"])
PY

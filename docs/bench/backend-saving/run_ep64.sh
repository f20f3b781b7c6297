#!/usr/bin/env bash
# The backend row at EP=64, 16384 tokens per rank after the H200 refit (the ring, saving; the constants of
# 2026-12-02 kept the all-to-all there), beside a2a eager and the saved ring.
# Usage: bash docs/bench/backend-saving/run_ep64.sh "$OUT"
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
sweep backend-ep64-16384 110 --ep 64 --tokens 16384 --rows "relaymoe backend" "ring expert saved"
# Where the owner rules step from 8/4 to 4/2 owners per hop and the models keep the traced all-to-all
# (H100 20480-30720, H200 20480-24576): the ring there, recomputing and saved, and a call's decision.
sweep ring-ep64-24576 90 --ep 64 --tokens 24576 --no-compile --rows "ring_moe default" "ring expert" "ring expert saved"
python - "$OUT" <<'PY'
import json, sys
for name in ("backend-ep64-16384", "ring-ep64-24576"):
    d = json.load(open(f"{sys.argv[1]}/{name}.json"))
    for dec in d["decisions"]:
        print(name, dec["execution"], "saves" if dec["saves_projections"] else "no save", dec["reason"],
              "| a call:", dec["call"])
PY

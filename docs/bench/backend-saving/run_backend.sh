#!/usr/bin/env bash
# After cost_model.SAVE_MARGIN (the default options save projections where a running ring is predicted within 10%
# of the all-to-all): the backend row beside a2a eager and the rings, EP=64 16384 (now saving) and 32768, EP=8
# 16384 (kept by the backend; a ring_moe call now runs the saved ring there, cost_model.choose(kept="op")), 5
# interleaved rounds each. Usage: bash docs/bench/backend-saving/run_backend.sh "$OUT"
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
sweep backend-ep64-16384 170 --ep 64 --tokens 16384 --rows "relaymoe backend" "ring expert" "ring expert saved"
sweep backend-ep64-32768 170 --ep 64 --tokens 32768 --rows "relaymoe backend" "ring expert" "ring expert saved"
sweep backend-ep8-16384 170 --ep 8 --tokens 16384 --rows "relaymoe backend" "ring_moe default" "ring expert saved"
python - "$OUT" <<'PY'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/backend-*.json")):
    d = json.load(open(f))
    for dec in d["decisions"]:
        print(f, dec["execution"], "saves" if dec["saves_projections"] else "no save", dec["reason"], "| a call:",
              dec["call"])
PY

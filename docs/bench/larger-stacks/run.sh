#!/usr/bin/env bash
# Larger owner stacks where the rules' ring would lose (issue 24, cost_model.choose "beyond the rules'"): at the
# token counts where the rules' owners step down and the all-to-all used to be kept, a call's default
# (`ring_moe default`: the widened stack) beside the forced ring (`ring expert`: the rules' stack) and a2a eager;
# then the backend rows there (compiled: the decision made at compile time). Stand-in EP, Qwen3 layer, bf16.
# Usage: bash docs/bench/larger-stacks/run.sh "$OUT" [backend]
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
sweep ring-ep64 200 --ep 64 --tokens 20480 24576 40960 --no-compile --rows "ring_moe default" "ring expert"
sweep ring-ep8 80 --ep 8 --tokens 16384 --no-compile --rows "ring_moe default" "ring expert" "ring expert saved"
if [ "${2:-}" = backend ]; then
  sweep backend-ep64 200 --ep 64 --tokens 16384 20480 --rows "relaymoe backend"
  # On the H200's constants the backend now runs EP=8 16384 as a 2 / 1 ring (it kept the all-to-all).
  sweep backend-ep8 150 --ep 8 --tokens 16384 --rows "relaymoe backend" "ring expert saved"
fi
python - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(f"{sys.argv[1]}/*.json")):
    d = json.load(open(f))
    for dec in d.get("decisions", []):
        print(f.split("/")[-1], dec["ep"], dec["tokens"], dec["execution"], dec["owners_per_hop"],
              "saves" if dec["saves_projections"] else "", "| a call:", dec.get("call"))
PY

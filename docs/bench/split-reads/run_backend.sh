#!/usr/bin/env bash
# The backend row beside a2a eager (5 interleaved rounds) after passes.split_reads, as raw-1-h100 ran it, one part
# per call: "all" every sweep token count at EP 64 and 8 with ring_moe's default; "dynamic" the backend with a
# static and a dynamic token count at 4096-16384; "refit" EP=64 16384-24576 after the kept ratio's refit
# (cost_model.KEPT_A2A_*). Usage: bash docs/bench/split-reads/run_backend.sh OUT all|dynamic|refit
set -uo pipefail
OUT=$1
source docs/bench/h200-sweep-2/setup.sh
case $2 in
  all)
    sweep backend-all-ep64 230 --ep 64 --rows "relaymoe backend" "ring_moe default"
    sweep backend-all-ep8 200 --ep 8 --rows "relaymoe backend" "ring_moe default" ;;
  dynamic)
    sweep dyn-ep64 200 --ep 64 --tokens 4096 8192 16384 --rows "relaymoe backend" "relaymoe backend, dynamic T"
    sweep dyn-ep8 150 --ep 8 --tokens 4096 8192 16384 --rows "relaymoe backend" "relaymoe backend, dynamic T" ;;
  refit)
    sweep after-refit-ep64 200 --ep 64 --tokens 16384 20480 24576 --rows "relaymoe backend" "ring_moe default" ;;
esac

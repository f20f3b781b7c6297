#!/bin/bash
# Issue 24: the full model with a dynamic token count (the default), after the token switch (runtime.token_switch):
# a2a eager beside relaymoe at T tokens per rank, one run. Usage (device tool):
#   bash docs/bench/h200-kept/run_switch.sh "$OUT" [T] [memory GiB] [time budget s] [link]
# "link": the stand-in's transfers on a stream of their own (--link-stream), results in full-switch-T-link.
OUT=${1:-/tmp/out}; T=${2:-8192}; MEM=${3:-80}; BUDGET=${4:-250}
FLAGS=(); NAME=full-switch-$T
[ "${5:-}" = link ] && { FLAGS=(--link-stream); NAME=$NAME-link; }
python -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
export OMP_NUM_THREADS=4 PYTHONPATH=$PWD
t0=$SECONDS
timeout $((BUDGET + 200)) python -m relay_compile.bench.full_model --preset h200 --memory-gib "$MEM" \
  --rows "a2a eager" relaymoe --start "$T" --max-tokens "$T" --repeats 5 --time-budget "$BUDGET" "${FLAGS[@]}" \
  --out "$OUT/$NAME" -v > "$OUT/$NAME.log" 2>&1
echo "full model T=$T ${FLAGS[*]} rc=$? [$((SECONDS-t0)) s]"
grep -v DEBUG "$OUT/$NAME.log" | grep -iE "token switch|kept variant|runs its|error|Traceback" | sort | uniq -c | head -20
cat "$OUT/$NAME/results.md" 2>/dev/null | head -40

# Usage (device tool): bash docs/bench/h200-aot-eager/run.sh "$OUT"
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
export OMP_NUM_THREADS=4 PYTHONPATH=$PWD
timeout 200 python docs/bench/h200-aot-eager/diag.py aot_eager relaymoe:aot_eager > "$OUT/diag.txt" 2>&1
echo "diag rc=$?"; grep -v DEBUG "$OUT/diag.txt" | grep -E "^(===|FAILED|---|exit|[0-9])|a2a / relaymoe|result"

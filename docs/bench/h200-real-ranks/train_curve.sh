# The training example every rank real on the H200 (issue 28 deliverable 4): 8 ranks, token routing, the ring forced
# (at 1024 tokens/rank the CUDA cost model would keep the all-to-all), fp32, 60 steps.
# Usage: bash ... "$OUT" [inner compiler: aot_eager (default) | eager | inductor]
# (raw-5 ran it with eager: aot_eager failed on CUDA until the example model's q/k norms came before the
# transpose, docs/bench/h200-aot-eager.)
OUT=${1:-/tmp/out}
INNER=${2:-aot_eager}
python -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
export OMP_NUM_THREADS=4 PYTHONPATH=$PWD
cd examples
C="--rank-threads 8 --device cuda --dtype float32 --routing token --ring always --hidden 256 --ffn 128 --experts 32 --top-k 4 --batch 4 --seq-len 256 --layers 2 --heads 4 --plot none.png"
timeout 400 python train_moe.py $C --steps 60 --inner-compiler "$INNER" --report-json "$OUT/train_$INNER.json" > "$OUT/train_$INNER.txt" 2>&1
echo "$INNER rc=$?"; grep -v DEBUG "$OUT/train_$INNER.txt" | sed 's/^\(\[rank[0-9]\]: \)*//' | awk '!s[$0]++' | grep -vE "^ +(\^|File|[a-z_]+ =)" | tail -25

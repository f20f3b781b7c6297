python -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
export OMP_NUM_THREADS=4 PYTHONPATH=$PWD
cd examples
C="--device cuda --dtype float32 --steps 4 --hidden 256 --ffn 128 --experts 32 --top-k 4 --batch 4 --seq-len 256 --layers 2 --heads 4 --plot none.png"
for v in "--rank-threads 2 --routing token --inner-compiler aot_eager" "--rank-threads 2 --routing expert --inner-compiler aot_eager" "--rank-threads 2 --routing token --inner-compiler eager" "--simulate-ep 2 --routing expert --inner-compiler aot_eager"; do
  echo "=== $v"
  timeout 100 python train_moe.py $v $C > /tmp/o.txt 2>&1; echo "rc=$?"
  grep -v DEBUG /tmp/o.txt | sed 's/^\(\[rank[0-9]\]: \)*//' | grep -E "result:|Error:|relay_compile/|reference.py|moe_transformer.py|runs as|routing auto|region 0" | awk '!s[$0]++' | head -14
done

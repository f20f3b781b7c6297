# Sourced by run*.sh (OUT set): install the checkout, record the GPU, and `sweep NAME SECONDS ARGS...`, one
# bounded `--preset sweep` whose sweep.json and log land in $OUT as NAME.json and NAME.log.
python -m pip install -q --no-deps --no-build-isolation --no-index -e . > /dev/null 2>&1
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee $OUT/env.txt
quiet() { grep --line-buffered -v "Warn\|warn_once\|USDT"; }
export PYTHONUNBUFFERED=1
sweep() {
  local name=$1 limit=$2; shift 2
  timeout $limit python -m relay_compile.bench --preset sweep --repeats 5 --warmup 2 --out /tmp/$name "$@" \
    2>&1 | quiet > $OUT/$name.log
  cp /tmp/$name/sweep.json $OUT/$name.json
  grep "|" $OUT/$name.log | cut -c1-130
}

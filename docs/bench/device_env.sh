# Sourced by the device scripts (docs/bench/*/run.sh) from the repository root: the carried wheels (.whl, and
# .whl-titan where present) into /tmp/site on PYTHONPATH, this checkout installed editable, the versions printed.
python -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl $(ls .whl-titan/*.whl 2>/dev/null) 2>&1 \
  | grep -v WARN | tail -1
export PYTHONPATH=/tmp/site
python -m pip install -q --no-deps --no-build-isolation --no-index -e . > /dev/null 2>&1
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

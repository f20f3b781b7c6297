#!/usr/bin/env bash
# Installs relay-compile and what its tests need into the current Python environment.
set -euo pipefail
cd "$(dirname "$0")"
# The CPU build of torch (a file on this workplace's disk); a plain `pip install torch` takes a CUDA build.
python -m pip install -q torch==2.13.0
# The project (editable) with its test extras, and what torchtitan's MoE import path needs beside torch
# (tyro, spmd_types, and triton, which it imports even on CPU), all with their own dependencies.
python -m pip install -q -e ".[test]" tyro spmd_types==0.2.3 triton
# The other real MoE packages the tests run unmodified (tests/thirdparty): Hugging Face transformers and DeepSpeed.
# DeepSpeed builds from its sdist; DS_BUILD_OPS=0 skips its CUDA/C++ ops (none of them is on the MoE layer's path).
DS_BUILD_OPS=0 python -m pip install -q transformers==5.24.0 deepspeed==0.19.8
# torchtitan 0.3.0 is the third-party MoE the backend must handle. Its declared dependencies (datasets, wandb,
# torchdata, ...) are not needed by its MoE layer and torchdata can drag in another torch: install it last and
# without them. (--no-deps also skips pip's check of installed packages, which would report them as an ERROR.)
python -m pip install -q --no-deps torchtitan==0.3.0
python -c "import torch, torchtitan.models.common.moe, transformers, deepspeed.moe.layer; print('installed: torch', torch.__version__, '+ torchtitan 0.3.0, transformers', transformers.__version__, ', deepspeed', deepspeed.__version__)"

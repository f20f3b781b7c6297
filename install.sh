#!/usr/bin/env bash
# Installs relay-compile and what its tests need into the current Python environment.
set -euo pipefail
cd "$(dirname "$0")"
# The CPU build of torch (a file on this workplace's disk); a plain `pip install torch` takes a CUDA build.
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test]"
# torchtitan 0.3.0 is the third-party MoE the backend must handle. Its declared dependencies (datasets, wandb,
# torchdata, ...) are not needed by its MoE layer and torchdata can drag in another torch: install it without
# them, plus the three modules its MoE import path needs (spmd_types, tyro, and triton, imported even on CPU).
python -m pip install -q --no-deps torchtitan==0.3.0 spmd_types==0.2.3 triton
python -m pip install -q tyro

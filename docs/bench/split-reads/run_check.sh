#!/usr/bin/env bash
# After the review's fixes to passes.split_reads: what the pass reports for the kept EP=64 region on CUDA (the
# host copies batch_host_reads makes there), then the backend row beside a2a eager at EP=64 4096 / 8192 and EP=8
# 4096 / 16384 (5 interleaved rounds; skipped with PART=report, where run_backend.sh all runs them).
# Usage: bash docs/bench/split-reads/run_check.sh OUT [report]
set -uo pipefail
OUT=$1 PART=${2:-all}
source docs/bench/h200-sweep-2/setup.sh
timeout 120 python - <<'PY' 2>&1 | quiet | grep -v "^\[" | tee $OUT/report.txt
import torch
from relay_compile.backend import compiled_reports
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group
from relay_compile.reference import a2a_moe
cfg = QWEN3_30B.with_(device="cuda", dtype="bf16", ep=64, tokens=8192)
group, inp = standin_group(64), make_inputs(cfg)
fn = torch.compile(lambda x, i, s, *w: a2a_moe(x, i, s, *w, group=group.group_name), backend="relaymoe",
                   fullgraph=True, dynamic=False)
with torch._dynamo.config.patch(capture_scalar_outputs=True):
    y = fn(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights)
y.backward(inp.grad_y_TH)
want = a2a_moe(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights, group=group)
print("max |y - eager|", (y - want).abs().max().item(), "max |eager|", want.abs().max().item())
print(compiled_reports()[-1].summary())
PY
[ "$PART" = report ] && exit 0
sweep check-ep64 120 --ep 64 --tokens 4096 8192 --rows "relaymoe backend"
sweep check-ep8 90 --ep 8 --tokens 4096 16384 --rows "relaymoe backend"

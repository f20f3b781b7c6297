"""What the host launches per EP=64 ring step (H200, Qwen3 layer, defaults): top-level aten ops and CUDA launch
calls by name, counted over one forward+backward under the torch profiler, with their mean host time.

    python docs/bench/h200-hostcost/op_census.py
"""
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group

cfg = QWEN3_30B.with_(device="cuda", dtype="bf16", ep=64, tokens=65536)
group = standin_group(64)
inp = make_inputs(cfg)


def step():
    inp.clear_grads()
    y = ring_moe(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights, group=group)
    y.backward(inp.grad_y_TH)


for _ in range(3):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    step()
    torch.cuda.synchronize()
count: collections.Counter = collections.Counter()
host_us: collections.Counter = collections.Counter()
for e in prof.events():
    top_aten = e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    if top_aten or e.name.startswith(("cuda", "cu")):
        count[e.name] += 1
        host_us[e.name] += e.cpu_time_total
aten = sum(c for n, c in count.items() if n.startswith("aten::"))
launches = sum(c for n, c in count.items() if "Launch" in n)
print(f"per step: {aten} top-level aten ops, {launches} kernel launches")
for name, c in count.most_common(40):
    print(f"{c:6d} {host_us[name] / c:8.1f} us  {name}")

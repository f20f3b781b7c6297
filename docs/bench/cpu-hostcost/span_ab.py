"""Host time of the ring at EP=64 on the CPU (stand-in group, tiny shapes: the step is Python and dispatch), with
transfers as spans (``transport._runs``) against one P2P operation per tensor, steps interleaved.

    OMP_NUM_THREADS=1 python docs/bench/cpu-hostcost/span_ab.py

It measures session 4's transport (``transport._runs``, replaced in session 5 by groups tagged on their views):
run it on a checkout of 6d65bb3. Session 4, 2 cores, idle machine, three runs (median ms per forward+backward,
spans / per tensor): 75.2 / 83.3, 77.4 / 72.8, 78.9 / 82.1: no host-time difference this measurement can resolve (EP=8: 24.2 / 24.0).
"""
import statistics
import time

import torch

from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group
from relay_compile.runtime import transport as T

torch.set_num_threads(1)
cfg = QWEN3_30B.with_(device="cpu", dtype="bf16", ep=64, tokens=256, hidden=16, ffn=8)
group = standin_group(64); inp = make_inputs(cfg)
orig_runs = T._runs
def per_tensor(ts): return [(i, i + 1) for i in range(len(ts))]
def step():
    inp.clear_grads(); t0 = time.perf_counter()
    y = ring_moe(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights, group=group, routing="expert")
    y.backward(inp.grad_y_TH); return (time.perf_counter() - t0) * 1e3
for _ in range(5): step()
res = {"spans": [], "per tensor": []}
for _ in range(40):
    T._runs = orig_runs; res["spans"].append(step())
    T._runs = per_tensor; res["per tensor"].append(step())
print({k: round(statistics.median(v), 1) for k, v in res.items()})

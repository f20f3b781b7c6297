"""Where the host time of one ring forward+backward goes (H200, simulated EP, Qwen3 layer): the top Python
and aten entries by self CPU time, and wall vs GPU time.

    python docs/bench/h200-memory/profile_hops.py OUT_DIR [--ep 64]
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--ep", type=int, default=64)
args = ap.parse_args()
cfg = QWEN3_30B.with_(device="cuda", dtype="bf16", ep=args.ep, tokens=65536)
group = standin_group(args.ep)
inp = make_inputs(cfg)


def step():
    y = ring_moe(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights, group=group, routing="expert")
    y.backward(inp.grad_y_TH)
    inp.clear_grads()


for _ in range(3):
    step()
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(5):
    step()
torch.cuda.synchronize()
print(f"EP={args.ep}: {(time.perf_counter() - t0) / 5 * 1e3:.1f} ms per step (wall)")
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
    step()
    torch.cuda.synchronize()
ka = prof.key_averages()
print(ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
print(prof.key_averages(group_by_stack_n=4).table(sort_by="self_cpu_time_total", row_limit=15,
                                                   max_name_column_width=60, max_src_column_width=90))
prof.export_chrome_trace(f"{args.out}/trace_ep{args.ep}.json")

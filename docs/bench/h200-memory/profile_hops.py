"""Where the host time of one ring forward+backward goes (H200, simulated EP, Qwen3 layer).

    python docs/bench/h200-memory/profile_hops.py OUT_DIR [--ep 64]             # torch.profiler (raw-sweep/profile64.txt)
    python docs/bench/h200-memory/profile_hops.py OUT_DIR [--ep 64] --cprofile  # Python functions (raw-sweep/pyprofile64.txt)

torch.profiler: the top aten and op entries by self CPU time, wall vs GPU time, a Chrome trace. ``--cprofile``:
host time per step (and to the next synchronize), then cProfile of ``--steps`` steps by tottime and cumulative.
"""
import argparse
import cProfile
import pstats
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
ap.add_argument("--cprofile", action="store_true")
ap.add_argument("--steps", type=int, default=3, help="cProfile: steps profiled")
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
for _ in range(3):
    t0 = time.perf_counter()
    step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    print(f"EP={args.ep}: host {1e3 * (t1 - t0):.1f} ms, to sync {1e3 * (time.perf_counter() - t0):.1f} ms")
if args.cprofile:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof).sort_stats("tottime")
    stats.print_stats(40)
    stats.sort_stats("cumulative").print_stats(40)
else:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as tprof:
        step()
        torch.cuda.synchronize()
    print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    tprof.export_chrome_trace(f"{args.out}/trace_ep{args.ep}.json")

"""Python-level profile (cProfile) of ring forward+backward steps (H200, simulated EP, Qwen3 layer): where the
host time of the host-bound EP=64 step goes, by function (tottime).

    python docs/bench/h200-memory/pyprofile_hops.py [--ep 64] [--steps 3]
"""
import argparse
import cProfile
import pstats
import time

import torch

from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group

ap = argparse.ArgumentParser()
ap.add_argument("--ep", type=int, default=64)
ap.add_argument("--steps", type=int, default=3)
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
prof = cProfile.Profile()
prof.enable()
for _ in range(args.steps):
    step()
torch.cuda.synchronize()
prof.disable()
stats = pstats.Stats(prof).sort_stats("tottime")
stats.print_stats(40)
stats.sort_stats("cumulative").print_stats(40)

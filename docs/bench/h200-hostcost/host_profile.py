"""Where the ring's host time goes at EP=64 on the GPU (H200, simulated EP, Qwen3 layer, defaults): per step the
wall time of forward+backward with the GPU synchronized after, the host time of the calls (no sync inside), then
cProfile over a few steps (tottime and cumtime tables).

    python docs/bench/h200-hostcost/host_profile.py OUT [--ep 64] [--steps 5]
"""
import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group
from relay_compile.reference import a2a_moe

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--ep", type=int, default=64)
ap.add_argument("--steps", type=int, default=5)
args = ap.parse_args()
cfg = QWEN3_30B.with_(device="cuda", dtype="bf16", ep=args.ep, tokens=65536)
group = standin_group(args.ep)
inp = make_inputs(cfg)


def ring():
    return ring_moe(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights, group=group)


def a2a():
    return a2a_moe(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights, group=group)


def step(layer):
    inp.clear_grads()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    y = layer()
    t1 = time.perf_counter()
    y.backward(inp.grad_y_TH)
    t2 = time.perf_counter()
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    return [(t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t0) * 1e3]


for name, layer in (("ring", ring), ("a2a", a2a)):
    for _ in range(3):
        step(layer)
    rows = [step(layer) for _ in range(10)]
    med = [statistics.median(c) for c in zip(*rows)]
    print(f"{name}: host fwd {med[0]:.1f} ms, host bwd {med[1]:.1f} ms, wall {med[2]:.1f} ms")
pr = cProfile.Profile()
pr.enable()
for _ in range(args.steps):
    step(ring)
pr.disable()
for key in ("tottime", "cumtime"):
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats(key).print_stats(60)
    text = s.getvalue()
    print(text)
    with open(f"{args.out}/profile_{key}.txt", "w") as f:
        f.write(text)

"""EP=64 ``ring_moe`` steps (H200, Qwen3 layer, defaults): the median host time of the forward and backward calls
and the median wall time per step, over 60 steps.

    python docs/bench/h200-hostcost/steps.py [--chunk-graphs]
"""
import argparse
import statistics
import time

import torch

from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group

ap = argparse.ArgumentParser()
ap.add_argument("--chunk-graphs", action="store_true", help="ring_moe(..., chunk_graphs=True)")
args = ap.parse_args()
cfg = QWEN3_30B.with_(device="cuda", dtype="bf16", ep=64, tokens=65536)
group = standin_group(64)
inp = make_inputs(cfg)


def step() -> tuple[float, float]:
    inp.clear_grads()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    y = ring_moe(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights, group=group,
                 chunk_graphs=args.chunk_graphs)
    y.backward(inp.grad_y_TH)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3, (time.perf_counter() - t0) * 1e3


for _ in range(3):
    step()
times = [step() for _ in range(60)]
print(f"host ms {statistics.median(h for h, _ in times):.1f} wall ms {statistics.median(w for _, w in times):.1f}")

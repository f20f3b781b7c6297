"""EP=64 ``ring_moe`` steps (H200, Qwen3 layer, 65536 tokens, defaults): median host ms of the forward call, of the
backward call, and median wall ms per step, over 60 steps. Runs against whatever ``relay_compile`` is imported
(``run.sh ab``: the baseline tree and this one in alternating processes).

    python docs/bench/h200-grouped-forward/steps.py [--ep 64] [--no-equal-groups]

``--no-equal-groups``: backward chunks not padded to equal groups (``runtime.equal_groups``; this tree only).
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
ap.add_argument("--ep", type=int, default=64)
ap.add_argument("--no-equal-groups", action="store_true")
args = ap.parse_args()
if args.no_equal_groups:
    from relay_compile.runtime import equal_groups

    equal_groups.applies = lambda device: False
cfg = QWEN3_30B.with_(device="cuda", dtype="bf16", ep=args.ep, tokens=65536)
group = standin_group(args.ep)
inp = make_inputs(cfg)


def step() -> tuple[float, float, float]:
    inp.clear_grads()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    y = ring_moe(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights, group=group)
    t1 = time.perf_counter()
    y.backward(inp.grad_y_TH)
    t2 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (time.perf_counter() - t0) * 1e3


for _ in range(3):
    step()
times = [step() for _ in range(60)]
med = [statistics.median(t[i] for t in times) for i in range(3)]
what = f"EP={args.ep}" + (" no equal groups" if args.no_equal_groups else "")
print(f"{what} host ms forward {med[0]:.1f} backward {med[1]:.1f} wall ms {med[2]:.1f}")

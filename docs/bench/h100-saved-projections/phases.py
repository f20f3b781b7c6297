"""Host time of a ring call's phases, forward and backward (issue 24): the op's local preparation, the agreement
(its exchange syncs host and device), the step's planning, the program's hops; median of 10 steps, no profiler
(stand-in group, Qwen3 layer, bf16, the expert ring forced).

    python docs/bench/h100-saved-projections/phases.py [--ep 8] [--tokens 16384]
"""
import argparse
import collections
import functools
import statistics
import time

import torch

from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group
from relay_compile.reference import a2a_moe
from relay_compile.runtime import hop_compute, ops

ap = argparse.ArgumentParser()
ap.add_argument("--ep", type=int, default=8)
ap.add_argument("--tokens", type=int, default=16384)
ap.add_argument("--backend", action="store_true",
                help="the compiled reference layer (torch.compile(a2a_moe, backend='relaymoe')) instead of ring_moe")
ap.add_argument("--inner", default="inductor", help="the backend's inner_compiler (inductor, aot_eager)")
args = ap.parse_args()
group = standin_group(args.ep)
inp = make_inputs(QWEN3_30B.with_(device="cuda", dtype="bf16", ep=args.ep, tokens=args.tokens))
spent: dict[str, list[float]] = collections.defaultdict(list)
direction = ["forward"]


def timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[f"{direction[0]} {name}"].append((time.perf_counter() - t) * 1e3)
    return wrapper


real_run = ops._run


def run(d, *a, **k):
    direction[0] = d
    return timed("op total", real_run)(d, *a, **k)


ops._run = run
ops.agree = timed("agreement", ops.agree)
ops.run_program = timed("hops", ops.run_program)
init = hop_compute.ExpertRoutingStep.__init__
hop_compute.ExpertRoutingStep.__init__ = timed("step plan", init)


compiled = torch.compile(lambda x, i, s, *w: a2a_moe(x, i, s, *w, group=group.group_name), backend="relaymoe",
                         fullgraph=True, options={"inner_compiler": args.inner})
given = collections.Counter()
prepare = ops._prepare


def spy_prepare(d, *a, **k):
    given[f"{d} given forward counts"] += (a[-1] if len(a) >= 9 else k.get("agreed_counts_E")) is not None
    return prepare(d, *a, **k)


ops._prepare = timed("prepare", spy_prepare)


def step():
    inp.clear_grads()
    x = inp.x_TH.detach().requires_grad_()
    if args.backend:
        y = compiled(x, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights)
    else:
        y = ring_moe(x, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights, group=group, ring="always",
                     routing="expert")
    y.backward(inp.grad_y_TH)


for _ in range(3):
    step()
torch.cuda.synchronize()
spent.clear()
walls, synced = [], []
for _ in range(10):
    t = time.perf_counter()
    step()
    walls.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    synced.append((time.perf_counter() - t) * 1e3)
print(f"EP={args.ep} tokens={args.tokens}{f' backend ({args.inner})' if args.backend else ''}: host per step "
      f"{statistics.median(walls):.2f} ms (median of 10, no sync), to the device's end {statistics.median(synced):.2f} ms")
for name, values in spent.items():
    print(f"  {name:<24} {statistics.median(values):7.3f} ms")
print(f"  calls given their forward's counts: {dict(given)}")

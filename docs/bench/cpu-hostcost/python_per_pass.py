"""The Python a hop pass costs the host, apart from its kernels: one forward + backward of the forced expert ring on
the stand-in group (CPU, tiny shapes), with the CPU reference paths of the hop-loop kernels (scatter-add of rows,
SwiGLU backward, fp32 grouped weight gradients) replaced by one op each, as CUDA runs them (one launch), and the
grouped GEMMs by an allocation (the CPU's are slow). What is left is the package's Python and aten dispatch per hop
pass; the device's host time per pass (docs/bench/hop-host/host_profile.py) less this is what launching costs there.
Numerics are not computed: this is a count, not a result.

    OMP_NUM_THREADS=1 python docs/bench/cpu-hostcost/python_per_pass.py [--ep 64] [--owners 4/2] [--top 25]
"""
import argparse
import collections
import time

import torch
from torch.profiler import profile

from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group
from relay_compile.kernels import grouped_weight_grad as gwg
from relay_compile.kernels import scatter_add_rows as sar
from relay_compile.kernels import swiglu_backward as sb
from relay_compile.runtime.programs import pipeline

ap = argparse.ArgumentParser()
ap.add_argument("--ep", type=int, default=64)
ap.add_argument("--owners", default="4/2", help="owners per forward/backward hop, forced: F/B")
ap.add_argument("--top", type=int, default=25)
args = ap.parse_args()
fwd_g, bwd_g = map(int, args.owners.split("/"))
pipeline.owners_per_hop = lambda shape: fwd_g
pipeline.backward_owners_per_hop = lambda shape: bwd_g
# One op each, as the CUDA kernels are one launch each.
sar.reference = lambda sum_TH, *a, **k: sum_TH.add_(0)
sb._reference_in_place = lambda h13, g, score, dh13: (dh13.add_(0), torch.zeros(g.shape[0]))[1]
sb._EAGER_BLOCK_ROWS = 1 << 30
gwg.applies = lambda *a, **k: True
gwg.grouped_weight_grad_ = lambda dy, x, offsets, out, accumulate=False: out.add_(0)
torch.set_num_threads(1)
cfg = QWEN3_30B.with_(device="cpu", dtype="bf16", ep=args.ep, tokens=256, hidden=16, ffn=8)
group = standin_group(args.ep)
inp = make_inputs(cfg)
passes = args.ep // fwd_g + args.ep // bwd_g


def step() -> None:
    inp.clear_grads()
    y = ring_moe(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights, group=group, ring="always",
                 routing="expert")
    y.backward(inp.grad_y_TH)


step()
step()
with profile() as prof:
    step()
aten = collections.Counter(e.name for e in prof.events()
                           if e.name.startswith("aten::") and (e.cpu_parent is None
                                                              or not e.cpu_parent.name.startswith("aten::")))
torch._grouped_mm = lambda a, b, offs=None, bias=None, out_dtype=None: a.new_empty((a.shape[0], b.shape[-1]))
for _ in range(3):
    step()
times = []
for _ in range(7):
    t = time.perf_counter()
    for _ in range(10):
        step()
    times.append((time.perf_counter() - t) / 10 * 1e3)
ms = sorted(times)[3]
print(f"EP={args.ep}, owners {args.owners}: {passes} hop passes; {sum(aten.values())} top-level aten ops per step "
      f"({sum(aten.values()) / passes:.1f} per pass); host {ms:.2f} ms per step, {ms * 1e3 / passes:.0f} us per pass "
      "(median of 7 x 10 steps)")
for name, n in aten.most_common(args.top):
    print(f"  {n:6d} {n / passes:6.1f}  {name}")

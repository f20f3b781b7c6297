"""The host work of one ring step at EP=64, counted instead of timed (deterministic on a noisy machine): Python
function calls and C calls (``sys.setprofile``), and top-level aten ops (the torch profiler), for one forward +
backward of ``ring_moe`` on the stand-in group (CPU, tiny shapes, default options).

    OMP_NUM_THREADS=1 python docs/bench/cpu-hostcost/host_work.py [--ep 64] [--top 15] [--owners 8/4]

``--owners F/B`` forces the owners per forward / backward hop of expert routing (the rules keep one at these
tiny shapes) and runs the expert ring forced, as at EP=64 and 16384 tokens.

Session 5 (2026-12-01), EP=64: session 4's final code (6d65bb3) 27170 Python calls, 30202 C calls, 10058 top-level
aten ops per step; after this session's transport, stand-in and backward cuts 14774 / 15908 / 7865 (the GPU
measurement of the same change: docs/bench/h200-ep64-host/, host time per step 74-111 ms -> 57-77 ms). Counts
on the CPU include the eager kernels' reference paths (``scatter_add_rows``, ``swiglu_backward``), which CUDA
runs as one Triton launch.
"""
import argparse
import collections
import sys

import torch
from torch.profiler import profile

from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group

ap = argparse.ArgumentParser()
ap.add_argument("--ep", type=int, default=64)
ap.add_argument("--top", type=int, default=15)
ap.add_argument("--owners", default=None, help="owners per forward/backward hop, forced: F/B")
args = ap.parse_args()
ring_opts = {} if args.owners is None else {"ring": "always", "routing": "expert"}
if args.owners is not None:
    from relay_compile.runtime.programs import pipeline

    fwd, bwd = map(int, args.owners.split("/"))
    pipeline.owners_per_hop = lambda shape: fwd
    pipeline.backward_owners_per_hop = lambda shape: bwd
torch.set_num_threads(1)
cfg = QWEN3_30B.with_(device="cpu", dtype="bf16", ep=args.ep, tokens=256, hidden=16, ffn=8)
group = standin_group(args.ep)
inp = make_inputs(cfg)


def step() -> None:
    inp.clear_grads()
    y = ring_moe(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights, group=group, **ring_opts)
    y.backward(inp.grad_y_TH)


step()
step()
calls: collections.Counter = collections.Counter()


def count(frame, event, arg) -> None:
    if event == "call":
        calls[f"{frame.f_code.co_filename.split('/')[-1]}:{frame.f_code.co_name}"] += 1
    elif event == "c_call":
        calls[f"C:{getattr(arg, '__qualname__', arg)}"] += 1


sys.setprofile(count)
step()
sys.setprofile(None)
with profile() as prof:
    step()
aten = collections.Counter(
    e.name for e in prof.events()
    if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
)
py = sum(n for k, n in calls.items() if not k.startswith("C:"))
print(f"EP={args.ep}: {py} Python calls, {sum(calls.values()) - py} C calls, {sum(aten.values())} top-level aten ops "
      "per step")
for k, n in [kv for kv in calls.most_common() if not kv[0].startswith("C:")][: args.top]:
    print(f"  {n:6d} {k}")
for k, n in aten.most_common(args.top):
    print(f"  {n:6d} {k}")

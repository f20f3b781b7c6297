"""Where the GPU idles inside one forward+backward (issue 24): the largest gaps between the step's kernels, each
with the op whose kernel ends it and that op's innermost relay_compile frames (stand-in group, Qwen3 layer, bf16).

    python docs/bench/h100-saved-projections/gaps.py [--ep 8] [--tokens 16384] [--row ring|a2a] [--top 15]

The profiler's own host overhead (stacks recorded) lengthens host-bound gaps: read where they are, not their size.
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group
from relay_compile.reference import a2a_moe

ap = argparse.ArgumentParser()
ap.add_argument("--ep", type=int, default=8)
ap.add_argument("--tokens", type=int, default=16384)
ap.add_argument("--row", choices=("ring", "a2a"), default="ring")
ap.add_argument("--top", type=int, default=15)
args = ap.parse_args()
group = standin_group(args.ep)
inp = make_inputs(QWEN3_30B.with_(device="cuda", dtype="bf16", ep=args.ep, tokens=args.tokens))


def step():
    inp.clear_grads()
    if args.row == "ring":
        y = ring_moe(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights, group=group, ring="always",
                     routing="expert")
    else:
        y = a2a_moe(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights, group=group)
    y.backward(inp.grad_y_TH)


for _ in range(3):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
    step()
    torch.cuda.synchronize()
# A CPU op's kernels carry a name and a duration only: a device event is matched to its op by both.
launched: dict[tuple[str, int], tuple[str, list[str]]] = {}
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::") and e.kernels:
        frames = [f for f in (e.stack or []) if "relay_compile" in f][:3]
        for k in e.kernels:
            launched[(k.name, round(k.duration))] = (e.name, frames)
device = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA)
first, last = device[0][0], max(end for _, end, _ in device)
busy_end, gaps = device[0][1], []
for start, end, name in device[1:]:
    if start > busy_end:
        gaps.append((start - busy_end, busy_end - first, name, start))
    busy_end = max(busy_end, end)
idle = sum(g for g, *_ in gaps)
print(f"EP={args.ep} tokens={args.tokens} {args.row}: span {(last - first) / 1e3:.2f} ms, idle {idle / 1e3:.2f} ms "
      f"in {len(gaps)} gaps ({sum(1 for g in gaps if g[0] > 50)} over 50 us)")
ends = {start: end for start, end, _ in device}
for gap, at, name, start in sorted(gaps, reverse=True)[: args.top]:
    op, frames = launched.get((name, round(ends[start] - start)), ("?", []))
    print(f"  {gap / 1e3:6.3f} ms idle at +{at / 1e3:6.2f} ms, then {name[:60]} ({op})")
    for f in frames:
        print(f"        {f}")

"""Where a ring step's host time goes on the H200 (issue 24): op census (top-level aten ops and launches per
fwd+bwd) and cProfile tottime/cumtime of ring_moe at one EP size and token count (stand-in group, Qwen3 layer).

    python docs/bench/h200-hop-host/profile_hop.py OUT [--ep 8] [--tokens 16384]
"""
import argparse
import collections
import cProfile
import io
import pstats

import torch
from torch.profiler import ProfilerActivity, profile

from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--ep", type=int, default=8)
ap.add_argument("--tokens", type=int, default=16384)
args = ap.parse_args()
cfg = QWEN3_30B.with_(device="cuda", dtype="bf16", ep=args.ep, tokens=args.tokens)
group = standin_group(args.ep)
inp = make_inputs(cfg)


def step():
    inp.clear_grads()
    y = ring_moe(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights, group=group, ring="always")
    y.backward(inp.grad_y_TH)


for _ in range(3):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    step()
    torch.cuda.synchronize()
count: collections.Counter = collections.Counter()
host_us: collections.Counter = collections.Counter()
for e in prof.events():
    top_aten = e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    if top_aten or e.name.startswith(("cuda", "cu")):
        count[e.name] += 1
        host_us[e.name] += e.cpu_time_total
aten = sum(c for n, c in count.items() if n.startswith("aten::"))
launches = sum(c for n, c in count.items() if "Launch" in n)
lines = [f"EP={args.ep} tokens={args.tokens}: per step {aten} top-level aten ops, {launches} kernel launches"]
lines += [f"{c:6d} {host_us[name] / c:8.1f} us  {name}" for name, c in count.most_common(45)]
print("\n".join(lines))
with open(f"{args.out}/census-ep{args.ep}-{args.tokens}.txt", "w") as f:
    f.write("\n".join(lines) + "\n")
pr = cProfile.Profile()
pr.enable()
for _ in range(3):
    step()
torch.cuda.synchronize()
pr.disable()
for key in ("tottime", "cumtime"):
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats(key).print_stats(45)
    text = s.getvalue()
    print(text[:9000] if key == "tottime" else text[:6000])
    with open(f"{args.out}/profile-ep{args.ep}-{args.tokens}-{key}.txt", "w") as f:
        f.write(text)

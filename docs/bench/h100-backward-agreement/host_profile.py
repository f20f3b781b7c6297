"""Where the host time of a step goes, compiled backend against ring_moe eager (cProfile, tottime; stand-in EP,
Qwen3 layer, bf16; the eager ring forced as the backend's: expert routing, no saved projections).

    python docs/bench/h100-backward-agreement/host_profile.py [--ep 64] [--tokens 16384] [--top 25]
"""
import argparse
import cProfile
import io
import pstats

import torch

from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group
from relay_compile.reference import a2a_moe

ap = argparse.ArgumentParser()
ap.add_argument("--ep", type=int, default=64)
ap.add_argument("--tokens", type=int, default=16384)
ap.add_argument("--top", type=int, default=25)
args = ap.parse_args()
group = standin_group(args.ep)
inp = make_inputs(QWEN3_30B.with_(device="cuda", dtype="bf16", ep=args.ep, tokens=args.tokens))
compiled = torch.compile(lambda x, i, s, *w: a2a_moe(x, i, s, *w, group=group.group_name), backend="relaymoe",
                         fullgraph=True)
rows = {
    "backend": lambda x: compiled(x, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights),
    "ring_moe": lambda x: ring_moe(x, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights, group=group,
                                   ring="always", routing="expert", save_projections=False),
}


def step(fn):
    inp.clear_grads()
    x = inp.x_TH.detach().requires_grad_()
    fn(x).backward(inp.grad_y_TH)
    torch.cuda.synchronize()


for name, fn in rows.items():
    for _ in range(3):
        step(fn)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        step(fn)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
    print(f"==== {name} EP={args.ep} tokens={args.tokens}, 5 steps")
    print("\n".join(line[:160] for line in out.getvalue().splitlines() if line.strip())[:9000])

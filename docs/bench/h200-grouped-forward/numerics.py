"""CUDA check of the session's two changes (H200, Qwen3 layer shapes, bf16, stand-in EP 64 and 8, defaults):

- the forward at its default owners per hop (EP=64 with 65536 tokens: two) against one owner per hop;
- the backward with chunks padded to equal groups against the same ring without them;
- both against a2a eager.

Each line: the largest difference of a result relative to the largest entry of the reference's.

    python docs/bench/h200-grouped-forward/numerics.py [--tokens 65536]

(raw-3 and raw-6 ran an earlier version at 8192 tokens, without the owners comparison: under the final rule
8192 tokens keep one owner per hop at EP=64, see docs/BENCHMARKS.md.)
"""
import argparse

from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group
from relay_compile.reference import a2a_moe
from relay_compile.runtime import equal_groups
from relay_compile.runtime.programs import pipeline

NAMES = ("y", "dx", "d_scores", "dw1", "dw2", "dw3")
ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=65536)
args = ap.parse_args()


def run(fn, inp, group):
    inp.clear_grads()
    y = fn(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights, group=group)
    y.backward(inp.grad_y_TH)
    return [y.detach().float(), *(t.grad.float() for t in inp.leaves())]


def rel(a, b):
    return (a - b).abs().max().item() / b.abs().max().item()


for ep in (64, 8):
    cfg = QWEN3_30B.with_(device="cuda", dtype="bf16", ep=ep, tokens=args.tokens)
    group = standin_group(ep)
    inp = make_inputs(cfg)
    for t in inp.leaves():
        t.requires_grad_()
    a2a = run(a2a_moe, inp, group)
    owners, used = [], []
    rule, plan = pipeline.owners_per_hop, equal_groups.EqualGroups.plan
    pipeline.owners_per_hop = lambda shape: owners.append(rule(shape)) or owners[-1]
    equal_groups.EqualGroups.plan = lambda *a: used.append(plan(*a)) or used[-1]
    default = run(ring_moe, inp, group)
    pipeline.owners_per_hop, equal_groups.EqualGroups.plan = (lambda shape: 1), plan
    one_owner = run(ring_moe, inp, group)
    pipeline.owners_per_hop = rule
    applies = equal_groups.applies
    equal_groups.applies = lambda device: False
    unpadded = run(ring_moe, inp, group)
    equal_groups.applies = applies
    ran = sum(1 for p in used if p is not None and p.used)
    print(f"EP={ep}, {args.tokens} tokens: {owners[0]} owners per forward hop, {ran} backward steps ran padded chunks")
    for name, d, o, u, a in zip(NAMES, default, one_owner, unpadded, a2a, strict=True):
        print(f"  {name:8s} default vs one owner {rel(d, o):.2e}  vs unpadded {rel(d, u):.2e}  vs a2a {rel(d, a):.2e}")

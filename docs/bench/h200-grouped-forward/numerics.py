"""CUDA check of the session's two changes (H200, Qwen3 layer shapes, 8192 tokens, bf16, stand-in EP 64 and 8):
ring_moe with backward chunks padded to equal groups against the same ring without them, and both against a2a
eager: the largest difference of each result relative to the largest entry of a2a's. (CPU tests cover the
logic; on CUDA the padded chunks run as batched GEMMs, bmm/baddbmm instead of grouped/per-expert GEMMs.)

    python docs/bench/h200-grouped-forward/numerics.py
"""

from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group
from relay_compile.reference import a2a_moe
from relay_compile.runtime import equal_groups

NAMES = ("y", "dx", "d_scores", "dw1", "dw2", "dw3")


def run(fn, inp, group):
    inp.clear_grads()
    y = fn(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights, group=group)
    y.backward(inp.grad_y_TH)
    return [y.detach().float(), *(t.grad.float() for t in inp.leaves())]


for ep in (64, 8):
    cfg = QWEN3_30B.with_(device="cuda", dtype="bf16", ep=ep, tokens=8192)
    group = standin_group(ep)
    inp = make_inputs(cfg)
    for t in inp.leaves():
        t.requires_grad_()
    a2a = run(a2a_moe, inp, group)
    used = []
    plan = equal_groups.EqualGroups.plan
    equal_groups.EqualGroups.plan = lambda *a: used.append(plan(*a)) or used[-1]
    padded = run(ring_moe, inp, group)
    equal_groups.EqualGroups.plan = plan
    applies = equal_groups.applies
    equal_groups.applies = lambda device: False
    plain = run(ring_moe, inp, group)
    equal_groups.applies = applies
    ran = sum(1 for p in used if p is not None and p.used)
    print(f"EP={ep}: {ran} backward steps ran padded chunks")
    for name, p, q, a in zip(NAMES, padded, plain, a2a, strict=True):
        scale = a.abs().max().item()
        print(f"  {name:8s} padded vs plain {(p - q).abs().max().item() / scale:.2e}  padded vs a2a "
              f"{(p - a).abs().max().item() / scale:.2e}  plain vs a2a {(q - a).abs().max().item() / scale:.2e}")

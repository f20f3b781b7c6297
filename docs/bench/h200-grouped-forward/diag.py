"""Why numerics.py read ring vs a2a 5.6 (relative) at EP=8 with 8192 tokens: every ring variant against a2a eager
(defaults, one owner per hop, whole hops, 4096-row chunks, sequential) at a few sizes, on the stand-in group.
Result (raw-4-diag/): all ring variants agree with each other, and session 6's tree (.ab_old) reads the same
5.6: a2a under the stand-in at these token counts is what differs (at 65536 tokens: 1e-2), not the ring.

    python docs/bench/h200-grouped-forward/diag.py
"""
import relay_compile.runtime.programs.pipeline as pl
import relay_compile.runtime.ring_options as ro
from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group
from relay_compile.reference import a2a_moe


def run(fn, inp, group, **kw):
    inp.clear_grads()
    y = fn(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights, group=group, **kw)
    y.backward(inp.grad_y_TH)
    return [y.detach().float(), *(t.grad.float() for t in inp.leaves())]

def err(r, a):
    return " ".join(f"{((p-q).abs().max()/q.abs().max()).item():.1e}" for p, q in zip(r, a))

for ep, tokens in ((8, 8192), (8, 4096), (16, 8192), (8, 65536)):
    cfg = QWEN3_30B.with_(device="cuda", dtype="bf16", ep=ep, tokens=tokens)
    group = standin_group(ep)
    inp = make_inputs(cfg)
    for t in inp.leaves():
        t.requires_grad_()
    a = run(a2a_moe, inp, group)
    # (As run in raw-4-diag, the rule read rows only: owners_per_hop(ep, tokens, 8).)
    shape = ro.HopShape.of(ep, [tokens], 8, [(w.shape, w.numel() * w.element_size()) for w in inp.weights],
                           cfg.hidden, 2)
    print(ep, tokens, "g", ro.owners_per_hop(shape), "default", err(run(ring_moe, inp, group), a), flush=True)
    orig = pl.owners_per_hop
    pl.owners_per_hop = lambda *a: 1
    print("   owners=1", err(run(ring_moe, inp, group), a), flush=True)
    pl.owners_per_hop = orig
    print("   max_hop_rows=None", err(run(ring_moe, inp, group, max_hop_rows=None), a), flush=True)
    print("   max_hop_rows=4096", err(run(ring_moe, inp, group, max_hop_rows=4096), a), flush=True)
    print("   overlap=False", err(run(ring_moe, inp, group, overlap=False), a), flush=True)

"""Every-rank-real group on CUDA: a2a_moe and ring_moe (both routings) on 4 real ranks, fp32, against the fp64
truth of every rank computed on one thread (the CPU test's check, on CUDA streams and link streams)."""
import torch
import torch.distributed as dist

from relay_compile import ring_moe
from relay_compile.bench.rank_threads import run_rank_threads
from relay_compile.reference import a2a_moe
from tests.bench.test_rank_threads import truth
from tests.test_ring_moe import local_weights, routed_inputs

for world in (2, 4):
    for case in ("random", "one_expert", "uneven", "one_rank"):
        e = 2 * world
        inputs = [routed_inputs(case, r, world, e, seed=3) for r in range(world)]
        grads = [torch.randn(x.shape, generator=torch.Generator().manual_seed(r)) for r, (x, _, _) in enumerate(inputs)]
        want = truth(inputs, grads, e)

        def step(rank, group):
            x, ids, scores = (t.cuda() for t in inputs[rank])
            out = {}
            for name, fn, kw in (("a2a", a2a_moe, {}), ("expert", ring_moe, {"routing": "expert", "ring": "always"}),
                                 ("token", ring_moe, {"routing": "token", "ring": "always"})):
                leaves = [t.clone().requires_grad_() for t in (x, scores, *(w.cuda() for w in local_weights(rank, 2, world)))]
                y = fn(leaves[0], ids, leaves[1], *leaves[2:], group=group, **kw)
                out[name] = [v.cpu() for v in (y.detach(), *torch.autograd.grad(y, leaves, grads[rank].cuda()))]
            return out

        got = run_rank_threads(world, step, device="cuda", timeout=120)
        worst = {}
        for rank in range(world):
            for name, values in got[rank].items():
                for g, w in zip(values, want[rank], strict=True):
                    err = (g.double() - w).abs().max().item() / max(w.abs().max().item(), 1e-30)
                    worst[name] = max(worst.get(name, 0.0), err)
        print(f"CUDA EP={world} {case}: worst relative error per block {worst}", flush=True)
        assert all(v < 1e-4 for v in worst.values()), worst
print("CUDA CHECK OK")

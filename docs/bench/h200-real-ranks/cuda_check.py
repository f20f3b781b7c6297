"""Every-rank-real group on CUDA: a2a_moe and ring_moe (both routings) on 2 and 4 real ranks, fp32, against each
rank's fp64 truth from dense_moe over all experts on one thread (the CPU tests' check, here on CUDA streams and
the group's link streams). Self-contained: the device has no test dependencies."""
import torch
import torch.distributed as dist

from relay_compile import ring_moe
from relay_compile.bench.rank_threads import run_rank_threads
from relay_compile.reference import a2a_moe, dense_moe, moe_weights

H, F, K, E_L = 64, 32, 3, 2
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs_of(case, rank, world):
    gen = torch.Generator().manual_seed(31 * rank + 7)
    t = 40 + 24 * rank if case == "uneven" else 48
    e = E_L * world
    x, scores = torch.randn(t, H, generator=gen), torch.rand(t, K, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:K] for _ in range(t)])
    if case == "one_expert":
        ids[:, 0] = e - 1
        ids[:, 1:] = torch.tensor(range(K - 1))
    if case == "one_rank":
        ids = torch.stack([torch.randperm(E_L, generator=gen)[: min(K, E_L)].repeat(2)[:K] for _ in range(t)])
    return x, ids, scores


for world in (2, 4):
    e = E_L * world
    full = moe_weights(0, H, F, e, dtype=torch.float64)
    for case in ("random", "one_expert", "uneven", "one_rank"):
        ins = [inputs_of(case, r, world) for r in range(world)]
        grads = [torch.randn(x.shape, generator=torch.Generator().manual_seed(r)) for r, (x, _, _) in enumerate(ins)]
        ws = [full[n].clone().requires_grad_() for n in ("w1", "w2", "w3")]
        want = []
        for (x, ids, s), g in zip(ins, grads):
            x64, s64 = x.double().requires_grad_(), s.double().requires_grad_()
            y = dense_moe(x64, ids, s64, *ws)
            want.append([y.detach(), *torch.autograd.grad(y, [x64, s64], g.double(), retain_graph=True)])
            y.backward(g.double())
        for r in range(world):
            want[r] += [w.grad[r * E_L:(r + 1) * E_L] for w in ws]

        def step(rank, group):
            x, ids, scores = (t.to(DEVICE) for t in ins[rank])
            local = moe_weights(0, H, F, e, experts=range(rank * E_L, (rank + 1) * E_L), device=DEVICE)
            out = {}
            for name, fn, kw in (("a2a", a2a_moe, {}), ("expert", ring_moe, {"routing": "expert", "ring": "always"}),
                                 ("token", ring_moe, {"routing": "token", "ring": "always"})):
                leaves = [t.clone().requires_grad_() for t in (x, scores, local["w1"], local["w2"], local["w3"])]
                y = fn(leaves[0], ids, leaves[1], *leaves[2:], group=group, **kw)
                out[name] = [v.cpu() for v in (y.detach(), *torch.autograd.grad(y, leaves, grads[rank].to(DEVICE)))]
            return out

        got = run_rank_threads(world, step, device=DEVICE, timeout=120)
        worst = {}
        for rank in range(world):
            for name, values in got[rank].items():
                for g, w in zip(values, want[rank], strict=True):
                    err = (g.double() - w).abs().max().item() / max(w.abs().max().item(), 1e-30)
                    worst[name] = max(worst.get(name, 0.0), err)
        print(f"{DEVICE} EP={world} {case}: worst relative error {({k: f'{v:.1e}' for k, v in worst.items()})}", flush=True)
        assert all(v < 1e-3 for v in worst.values()), worst
print("CUDA CHECK OK")

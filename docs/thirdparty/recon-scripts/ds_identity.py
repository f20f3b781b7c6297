"""Recon, one process: DeepSpeed 0.19.8's sparse dispatch/combine equals sum_k gates[k,t] * F_{ids[k,t]}(x[t]) over
routes with ids[k,t] >= 0 (the pairs a ring would run), with drops forced by a small capacity."""
import torch
from deepspeed.moe import sharded_moe as sm

torch.manual_seed(0)
T, E, H = 16, 4, 8
x = torch.randn(T, H)
logits = torch.randn(T, E)
for k, fn in ((1, lambda: sm.top1gating(logits.clone(), 0.5, 1, use_rts=False, sparse_routes=True)),
              (2, lambda: sm.top2gating(logits.clone(), 0.5, 1, top2_2nd_expert_sampling=False, sparse_routes=True)),
              (3, lambda: sm.topkgating(logits.clone(), 3, 0.5, 1, sparse_routes=True))):
    l_aux, C, E_, ids, loc, gates, counts = fn()
    C = int(C)
    slots = sm._route_slots(ids, loc, E, C)
    buf = sm._sparse_encode(x, slots, E, C)                        # (E, C, H)
    out = buf * (torch.arange(E, dtype=x.dtype) + 1)[:, None, None]  # expert e: x -> (e + 1) x
    y = sm._sparse_decode(out.view(E * C, H), slots, gates, T)
    keep = ids >= 0
    scale = torch.where(keep, ids.long() + 1, 0).to(x.dtype) * gates * keep   # (K, T)
    ref = (scale[:, :, None] * x[None]).sum(0)
    print(f"k={k}: C={C}, ids shape {tuple(ids.shape)} dtype {ids.dtype}, dropped routes {(~keep).sum().item()}, "
          f"gates of dropped routes max {gates[~keep].abs().max().item() if (~keep).any() else 0.0:.3g}, "
          f"max |y - ring form| {(y - ref).abs().max().item():.2e}")

"""CUDA check of the all-to-all path (issue 24): ``ring_moe(..., ring="never")`` against the reference layer
``a2a_moe`` and the expert ring on the stand-in group, Qwen3 layer, bf16; max |diff| / max |a2a| per output.

    python docs/bench/h200-time-model/check.py [--ep 8 64] [--tokens 8192]
"""

from __future__ import annotations

import argparse

import torch

from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group
from relay_compile.reference import a2a_moe


def outputs(fn, inp, **kw) -> list[torch.Tensor]:
    inp.clear_grads()
    y = fn(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights, **kw)
    y.backward(inp.grad_y_TH)
    return [y.detach().float(), *(t.grad.float() for t in inp.leaves())]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ep", type=int, nargs="+", default=[8, 64])
    p.add_argument("--tokens", type=int, default=8192)
    args = p.parse_args()
    names = ("y", "dx", "d_scores", "dw1", "dw2", "dw3")
    for ep in args.ep:
        cfg = QWEN3_30B.with_(ep=ep, tokens=args.tokens, device="cuda", dtype="bf16")
        group = standin_group(ep)
        inp = make_inputs(cfg)
        want = outputs(a2a_moe, inp, group=group)
        for label, kw in (("all-to-all path (ring='never')", {"ring": "never"}),
                          ("expert ring (ring='always')", {"ring": "always", "routing": "expert"})):
            got = outputs(ring_moe, inp, group=group, **kw)
            errs = [((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item() for g, w in zip(got, want)]
            print(f"EP={ep} T={args.tokens} {label:<32} vs a2a eager: "
                  + ", ".join(f"{n} {e:.2e}" for n, e in zip(names, errs)), flush=True)


if __name__ == "__main__":
    main()

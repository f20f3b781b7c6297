"""The forced ring with its rows read at their indices and/or its sums added by its GEMMs, against the same ring with
its rows gathered first and its sums added after its GEMMs (the options ``gather_in_gemm``, ``add_in_gemm``): output and
gradients of one forward+backward on the stand-in group (CUDA, bf16, Qwen3 layer), as max error relative to each
tensor's largest value.

    python docs/bench/gathered-gemm/check_ring.py [--ep 8] [--tokens 8192]
"""
import argparse

import torch

from relay_compile.bench.sweep import standin_rows

ROWS = ("ring auto", "ring auto, gather in GEMM", "ring auto, add in GEMM",
        "ring auto, gather and add in GEMM")


def step(fn, inp):
    x, scores = inp.x_TH, inp.topk_scores_TK
    for t in (x, scores, *inp.weights):
        t.grad = None
    y = fn(x, inp.topk_ids_TK, scores, *inp.weights)
    y.backward(inp.grad_y_TH)
    return [y.detach().float(), x.grad.float(), scores.grad.float(), *(w.grad.float() for w in inp.weights)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    inp, fns = standin_rows(args.ep, args.tokens, ROWS)
    for t in inp.weights:
        t.requires_grad_()
    want = step(fns[ROWS[0]], inp)
    names = ["y", "dx", "d_scores", "dw1", "dw2", "dw3"]
    worst = 0.0
    for row in ROWS[1:]:
        for name, a, b in zip(names, want, step(fns[row], inp), strict=True):
            rel = ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item()
            worst = max(worst, rel)
            print(f"EP={args.ep} T={args.tokens} {row} against {ROWS[0]}, {name}: max rel err {rel:.2e}")
    print("ok" if worst < 2e-2 else f"FAILED: {worst:.2e}")


if __name__ == "__main__":
    main()

"""The stand-in's link stream on CUDA (``standin_group(n, link_stream=True)``): the ring computes the same layer
as on the plain stand-in (forward and backward), and how much of the step the transfers' copies took.

    python docs/bench/link-stream/check.py [--ep 8] [--tokens 16384]

Prints the largest difference of y, dx, d_scores and each weight gradient between the two groups beside the one
between two runs on the plain group (the fp32 atomics of the sums add in any order), then the median step of
each over 5 interleaved rounds.
"""
import argparse
import statistics

import torch

from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group

ap = argparse.ArgumentParser()
ap.add_argument("--ep", type=int, default=8)
ap.add_argument("--tokens", type=int, default=16384)
args = ap.parse_args()
cfg = QWEN3_30B.with_(device="cuda", dtype="bf16", ep=args.ep, tokens=args.tokens)
inp = make_inputs(cfg)
groups = {"plain": standin_group(args.ep), "link stream": standin_group(args.ep, link_stream=True)}


def run(group) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in (inp.x_TH, inp.topk_scores_TK, *inp.weights)]
    y = ring_moe(leaves[0], inp.topk_ids_TK, leaves[1], *leaves[2:], group=group, ring="always", routing="expert")
    grads = torch.autograd.grad(y, leaves, inp.grad_y_TH)
    return [y.detach(), *grads]


names = ["y", "dx", "d_scores", "dw1", "dw2", "dw3"]
base, again, linked = run(groups["plain"]), run(groups["plain"]), run(groups["link stream"])
for name, b, a, l in zip(names, base, again, linked):
    scale = b.float().abs().max().item()
    print(f"{name:9s} max|plain - plain| {(a.float() - b.float()).abs().max().item() / scale:.2e}  "
          f"max|link - plain| {(l.float() - b.float()).abs().max().item() / scale:.2e}  (relative to max|plain|)")
    # A copy racing its reader would corrupt whole rows (errors of the order of the values): far above the
    # run-to-run differences of the fp32 atomics, which bound it here.
    plain_diff = (a.float() - b.float()).abs().max().item()
    link_diff = (l.float() - b.float()).abs().max().item()
    assert link_diff <= max(4 * plain_diff, 1e-3 * scale), f"{name}: link stream differs by {link_diff:.3e}"
times: dict[str, list[float]] = {k: [] for k in groups}
for _ in range(5):
    for label, group in groups.items():
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(group)
        end.record()
        torch.cuda.synchronize()
        times[label].append(start.elapsed_time(end))
plain = statistics.median(times["plain"])
for label, ts in times.items():
    print(f"EP={args.ep} T={args.tokens} ring expert, {label}: {statistics.median(ts):.2f} ms "
          f"({statistics.median(ts) / plain:.3f}x plain; spread {(max(ts) - min(ts)) / statistics.median(ts):.1%})")

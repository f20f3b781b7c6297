"""The stand-in's link stream on CUDA (``standin_group(n, link_stream=True)``): the ring computes the same layer
as on the plain stand-in (forward and backward), and how much of the step the transfers' copies took. Also the
first CUDA check of the agreement read beside the compute stream with the count-free work queued ahead of it
(``runtime.queued_ahead``): a call with that work queued against one without it (``QueuedAhead.queue`` a no-op),
and the ring against a2a eager's layer on the same stand-in (exact for expert routing, bf16 rounding apart).

    python docs/bench/link-stream/check.py [--ep 8] [--tokens 16384]

Prints the largest difference of y, dx, d_scores and each weight gradient between the two groups, and between calls
with and without the queued work, beside the one between two runs on the plain group (the fp32 atomics of the sums
add in any order), and the ring's against a2a eager's; then the median step of each group over 5 interleaved
rounds. Fails (assert) where a difference exceeds its bound.
"""
import argparse
import statistics

import torch

from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group
from relay_compile.reference import a2a_moe
from relay_compile.runtime.queued_ahead import QueuedAhead

ap = argparse.ArgumentParser()
ap.add_argument("--ep", type=int, default=8)
ap.add_argument("--tokens", type=int, default=16384)
args = ap.parse_args()
cfg = QWEN3_30B.with_(device="cuda", dtype="bf16", ep=args.ep, tokens=args.tokens)
inp = make_inputs(cfg)
groups = {"plain": standin_group(args.ep), "link stream": standin_group(args.ep, link_stream=True)}


def run(group, layer=ring_moe, **kwargs) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in (inp.x_TH, inp.topk_scores_TK, *inp.weights)]
    y = layer(leaves[0], inp.topk_ids_TK, leaves[1], *leaves[2:], group=group, **kwargs)
    grads = torch.autograd.grad(y, leaves, inp.grad_y_TH)
    return [y.detach(), *grads]


def run_ring(group) -> list[torch.Tensor]:
    return run(group, ring="always", routing="expert")


def unqueued(group) -> list[torch.Tensor]:
    queue, QueuedAhead.queue = QueuedAhead.queue, lambda self: None
    try:
        return run_ring(group)
    finally:
        QueuedAhead.queue = queue


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


names = ["y", "dx", "d_scores", "dw1", "dw2", "dw3"]
run_ring(groups["plain"])  # the spec's first call: nothing queued yet (it follows the execution run last)
base, again, bare = run_ring(groups["plain"]), run_ring(groups["plain"]), unqueued(groups["plain"])
run_ring(groups["link stream"])
linked, eager = run_ring(groups["link stream"]), run(groups["plain"], a2a_moe)
for name, b, a, n, l, e in zip(names, base, again, bare, linked, eager):
    scale = b.float().abs().max().item()
    print(f"{name:9s} max|plain - plain| {diff(a, b) / scale:.2e}  max|unqueued - queued| {diff(n, b) / scale:.2e}  "
          f"max|link - plain| {diff(l, b) / scale:.2e}  max|ring - a2a eager| {diff(e, b) / scale:.2e}  "
          "(relative to max|plain|)")
    # A copy racing its reader, or a queued sort or sum read before it is done, would corrupt whole rows (errors
    # of the order of the values): far above the run-to-run differences of the fp32 atomics, which bound it here,
    # and above a2a eager's bf16 roundings (its combine sums in bf16).
    bound = max(4 * diff(a, b), 1e-3 * scale)
    assert diff(l, b) <= bound, f"{name}: link stream differs by {diff(l, b):.3e}"
    assert diff(n, b) <= bound, f"{name}: the call without queued work differs by {diff(n, b):.3e}"
    assert diff(e, b) <= 5e-2 * scale, f"{name}: the ring differs from a2a eager by {diff(e, b):.3e}"
times: dict[str, list[float]] = {k: [] for k in groups}
for _ in range(5):
    for label, group in groups.items():
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run_ring(group)
        end.record()
        torch.cuda.synchronize()
        times[label].append(start.elapsed_time(end))
plain = statistics.median(times["plain"])
for label, ts in times.items():
    print(f"EP={args.ep} T={args.tokens} ring expert, {label}: {statistics.median(ts):.2f} ms "
          f"({statistics.median(ts) / plain:.3f}x plain; spread {(max(ts) - min(ts)) / statistics.median(ts):.1%})")

"""Can a device-to-device copy on one stream run beside a GEMM on another, on this GPU? (The stand-in's link
stream, ``standin_group(n, link_stream=True)``, copies with ``Tensor.copy_``, a DtoD ``cudaMemcpyAsync``.)

For a hop-sized GEMM (the EP=8, 65536-token hop: 65536 rows x 2048 -> 1536, bf16) and a transfer-sized copy
(``--mib``, default 432: one backward transfer, 16 experts' bf16 weights and fp32 gradient sums, 453 MB), each alone and
then both queued together on two streams, with the copy as a DtoD memcpy, as an elementwise kernel (``add`` of
zero) and as ``kernels.bounded_copy`` over 8, 16 and 32 thread blocks (the stand-in's ``link_ctas``: NCCL's
channels take a few SMs), the last two also on a stream of the highest priority (``link_high_priority``); each
pair queued GEMM first, then copy first. CUDA events, medians of 20. "overlap" is how
much of the shorter one the pair hid: (alone_a + alone_b - together) / min(alone_a, alone_b).

    python docs/bench/link-stream/concurrency.py [--mib 432]
"""
import argparse
import statistics
from collections.abc import Callable

import torch

from relay_compile.kernels.bounded_copy import bounded_copy_

ap = argparse.ArgumentParser()
ap.add_argument("--mib", type=int, default=432)
args = ap.parse_args()
dev = torch.device("cuda")
compute, link = torch.cuda.current_stream(dev), torch.cuda.Stream(dev)
a = torch.randn(65536, 2048, device=dev, dtype=torch.bfloat16)
w = torch.randn(2048, 1536, device=dev, dtype=torch.bfloat16)
# Finite values (random bytes hold NaNs, whose payload an elementwise add need not keep).
src = torch.randn(args.mib << 19, device=dev, dtype=torch.bfloat16)
high = torch.cuda.Stream(dev, priority=-1)
dst = torch.empty_like(src)


def gemm() -> None:
    torch.mm(a, w)


def memcpy() -> None:
    with torch.cuda.stream(link):
        dst.copy_(src)


def kernel_copy() -> None:
    with torch.cuda.stream(link):
        torch.add(src, 0, out=dst)


def bounded(ctas: int, stream: torch.cuda.Stream = link) -> Callable[[], None]:
    def fn() -> None:
        with torch.cuda.stream(stream):
            bounded_copy_(dst, src, ctas)

    return fn


def timed(*fns: Callable[[], None]) -> float:
    """Milliseconds from queueing all of ``fns`` (each on its own stream) until all are done."""
    times = []
    for _ in range(22):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(compute)
        link.wait_stream(compute)
        high.wait_stream(compute)
        for fn in fns:
            fn()
        compute.wait_stream(link)
        compute.wait_stream(high)
        end.record(compute)
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


g = timed(gemm)
print(f"{torch.cuda.get_device_name()}; GEMM 65536x2048x1536 bf16 alone {g:.3f} ms; copy of {args.mib} MiB")
print("| copy as | copy alone ms | GEMM queued first: together ms (overlap) | copy queued first: together ms (overlap) |")
print("|---|---:|---:|---:|")
variants = [("DtoD memcpy (Tensor.copy_)", memcpy), ("elementwise kernel (add 0)", kernel_copy)]
variants += [(f"bounded_copy, {n} blocks", bounded(n)) for n in (8, 16, 32)]
variants += [(f"bounded_copy, {n} blocks, high-priority stream", bounded(n, high)) for n in (16, 32)]
for name, fn in variants:
    dst.zero_()
    fn()
    torch.cuda.synchronize()
    assert torch.equal(dst.view(torch.int16), src.view(torch.int16)), name
    c, both, first = timed(fn), timed(gemm, fn), timed(fn, gemm)
    print(f"| {name} | {c:.3f} | {both:.3f} ({(g + c - both) / min(g, c):.0%}) | {first:.3f} "
          f"({(g + c - first) / min(g, c):.0%}) |")

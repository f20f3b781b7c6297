"""Does the order of a chunk's rows, or the atomics, set the time of the ring's fp32 scatter-add? (issue 24)

The fp32 scatter-add of a chunk's rows into the ring's ``(T, H)`` sum (``kernels.scatter_add_rows``) is 8.9 ms of
the forced EP=8 65536-token ring's 48 ms of kernels on an H100 (docs/bench/h100-recheck/raw-1-h100). It reaches
2.4 TB/s of HBM traffic (rows read, fp32 sums read and written). This measures, at the hop's chunk shapes with
routing as the ring sees it (a hop's pairs sorted by expert, a token at most once per expert, up to K times per
chunk), per call of each form:

- ``atomic, expert order``: the library's kernel as the ring calls it;
- ``atomic, token order``: the same atomics, rows visited in token order (a stable sort of the chunk's tokens):
  whether the sum's rows read in address order run faster;
- ``segmented, token order``: one program per run of equal tokens sums the run's rows in registers and reads and
  writes its sum row once, without atomics (deterministic; a token met twice in a chunk costs one read-modify-write);
- ``plain RMW, unique tokens``: load, add, store of distinct rows, no atomics (what the traffic alone costs);
- ``sort``: ``torch.sort(tok, stable=True)`` of the chunk's tokens (what the token order costs to compute);
- ``copy``: a copy of the same number of bytes (the device's streaming rate).

    python docs/bench/scatter-order/scatter_order.py [--tokens 65536] [--hidden 2048]
"""
import argparse

import torch
import triton
import triton.language as tl

from relay_compile.bench.inputs import first_hop_chunks
from relay_compile.bench.measure import gpu_us_per_call
from relay_compile.kernels import scatter_add_rows as sar

BLOCK_H, WARPS = 512, 8


@triton.jit
def atomic_perm_kernel(sum_ptr, tok_ptr, perm_ptr, rows_ptr, scale_ptr, hidden, stride_sum, stride_rows,
                       BLOCK_H: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    row = tl.load(perm_ptr + i).to(tl.int64)
    value = tl.load(rows_ptr + row * stride_rows + cols, mask=mask).to(tl.float32) * tl.load(scale_ptr + row)
    token = tl.load(tok_ptr + i).to(tl.int64)
    tl.atomic_add(sum_ptr + token * stride_sum + cols, value, mask=mask, sem="relaxed")


@triton.jit
def segmented_kernel(sum_ptr, tok_ptr, perm_ptr, rows_ptr, scale_ptr, n, hidden, stride_sum, stride_rows,
                     BLOCK_H: tl.constexpr):
    """Program ``i`` heads the run of equal tokens starting at sorted position ``i`` (else it returns)."""
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    token = tl.load(tok_ptr + i)
    before = tl.load(tok_ptr + i - 1, mask=i > 0, other=-1)
    if before != token:
        dest = sum_ptr + token.to(tl.int64) * stride_sum + cols
        acc = tl.load(dest, mask=mask)
        j = i
        t = token
        while t == token:
            row = tl.load(perm_ptr + j).to(tl.int64)
            acc += tl.load(rows_ptr + row * stride_rows + cols, mask=mask).to(tl.float32) * tl.load(scale_ptr + row)
            j += 1
            t = tl.load(tok_ptr + j, mask=j < n, other=-1)
        tl.store(dest, acc, mask=mask)


@triton.jit
def plain_rmw_kernel(sum_ptr, tok_ptr, rows_ptr, scale_ptr, hidden, stride_sum, stride_rows, BLOCK_H: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    value = tl.load(rows_ptr + i * stride_rows + cols, mask=mask).to(tl.float32) * tl.load(scale_ptr + i)
    dest = sum_ptr + tl.load(tok_ptr + i).to(tl.int64) * stride_sum + cols
    tl.store(dest, tl.load(dest, mask=mask) + value, mask=mask)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--hidden", type=int, default=2048)
    args = ap.parse_args()
    T, H = args.tokens, args.hidden
    gen = torch.Generator(device="cuda").manual_seed(0)
    sum_TH = torch.zeros(T, H, device="cuda")
    print(f"T={T} H={H} E=128 K=8 EP=8, first hop; GPU us per call (50 calls); HBM bytes = rows read + sums read "
          "and written")
    print("| chunk | rows | distinct tokens | form | us | TB/s | max err vs reference |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for chunks in (4, 2, 1):
        tok_S = first_hop_chunks(T, 128, 8, 8, chunks, gen)[0][0]
        S = tok_S.numel()
        rows_SH = torch.randn(S, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        scale_S = torch.rand(S, device="cuda", generator=gen)
        tok_sorted, perm = torch.sort(tok_S, stable=True)
        distinct = int(torch.unique(tok_S).numel())
        want = torch.zeros_like(sum_TH)
        sar.reference(want, tok_S, rows_SH, scale_S[:, None])
        grid = (S, triton.cdiv(H, BLOCK_H))

        def atomic():
            sar.scatter_add_rows_(sum_TH, tok_S, rows_SH, scale_S[:, None])

        def atomic_perm():
            atomic_perm_kernel[grid](sum_TH, tok_sorted, perm, rows_SH, scale_S, H, H, H, BLOCK_H=BLOCK_H,
                                     num_warps=WARPS)

        def segmented():
            segmented_kernel[grid](sum_TH, tok_sorted, perm, rows_SH, scale_S, S, H, H, H, BLOCK_H=BLOCK_H,
                                   num_warps=WARPS)

        forms = {"atomic, expert order": (atomic, S), "atomic, token order": (atomic_perm, S),
                 "segmented, token order": (segmented, distinct)}
        for name, (fn, sums) in forms.items():
            sum_TH.zero_()
            fn()
            err = (sum_TH - want).abs().max().item()
            us = gpu_us_per_call(fn)
            tb = (S * H * 2 + sums * H * 8) / us / 1e6
            print(f"| {chunks} per hop | {S} | {distinct} | {name} | {us:.1f} | {tb:.2f} | {err:.1e} |")
        us = gpu_us_per_call(lambda: torch.sort(tok_S, stable=True))
        print(f"| {chunks} per hop | {S} | {distinct} | sort | {us:.1f} | | |")
        uniq = torch.randperm(T, device="cuda", generator=gen)[:S]
        us = gpu_us_per_call(lambda: plain_rmw_kernel[grid](sum_TH, uniq, rows_SH, scale_S, H, H, H,
                                                            BLOCK_H=BLOCK_H, num_warps=WARPS))
        print(f"| {chunks} per hop | {S} | {S} | plain RMW, unique tokens | {us:.1f} | {S * H * 10 / us / 1e6:.2f} | |")
        src = torch.empty(S * H * 10 // 2 // 4, device="cuda")  # a copy moving the same bytes (read + write)
        dst = torch.empty_like(src)
        us = gpu_us_per_call(lambda: dst.copy_(src))
        print(f"| {chunks} per hop | {S} | | copy of the same bytes | {us:.1f} | {S * H * 10 / us / 1e6:.2f} | |")
        del src, dst


if __name__ == "__main__":
    main()

"""``dst.copy_(src)`` by a fixed number of thread blocks: a copy that leaves most of the SMs to other streams.

The stand-in group's link stream (``bench.standin_group``, ``link_ctas``) copies a transfer with it to model what
an NCCL send/receive takes from the GPU it runs on: a few CTAs (NCCL's channels) looping over the message, beside
whatever the compute stream runs. A ``Tensor.copy_`` between two buffers of one GPU is a copy over a grid as large
as the message, and it barely runs beside the hops' persistent GEMMs (one H100: 13% of a 453 MiB copy
overlapped a 65536x2048x1536 GEMM; docs/bench/h100-recheck). Over 8-32 blocks, queued before such a GEMM, two
thirds to three quarters of it overlapped; queued after it, the pair took 1.9-2.9x as long as the two in turn
(docs/bench/link-stream/raw-3-h100/concurrency.txt). Elsewhere (no Triton, CPU, mismatched tensors):
``Tensor.copy_``, the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from relay_compile.kernels import interpreted, triton_kernel

# Bytes each block moves per loop step (256 threads x 16-byte vectors x 4).
_BLOCK_BYTES = 16384


def _applies(dst: Tensor, src: Tensor) -> bool:
    """Both on one CUDA device (or under Triton's interpreter), contiguous, plain (not a conjugate or negative
    view), the same dtype and size, a multiple of 64 bytes from 16-byte aligned addresses: the kernel moves int32
    words, and a word count that is a multiple of 16 lets Triton move them as 16-byte vectors."""
    on_device = dst.is_cuda and src.is_cuda and dst.device == src.device
    return ((on_device or interpreted()) and dst.is_contiguous() and src.is_contiguous()
            and not (src.is_conj() or src.is_neg() or dst.is_conj() or dst.is_neg())
            and dst.dtype == src.dtype and dst.numel() == src.numel() and dst.nbytes % 64 == 0
            and dst.data_ptr() % 16 == 0 and src.data_ptr() % 16 == 0)


def bounded_copy_(dst: Tensor, src: Tensor, ctas: int) -> None:
    """``dst.copy_(src)`` by ``ctas`` thread blocks where the kernel applies, else ``Tensor.copy_``."""
    kernel = _triton_kernel() if ctas > 0 and _applies(dst, src) else None
    if kernel is None:
        dst.copy_(src)
        return
    words = dst.nbytes // 4
    if words:
        block = 16 if interpreted() else _BLOCK_BYTES // 4  # the interpreter: several steps per block
        grid = (min(ctas, -(-words // block)),)
        kernel[grid](dst.view(-1).view(torch.int32), src.view(-1).view(torch.int32), words, BLOCK=block,
                     num_warps=8)


def _build(triton: Any, tl: Any) -> Callable:
    """The Triton kernel (``kernels.triton_kernel`` compiles it on first use)."""

    @triton.jit
    def bounded_copy_kernel(dst_ptr, src_ptr, words, BLOCK: tl.constexpr):
        # Block b copies steps b, b + nblocks, ...: a fixed grid, however large the message.
        step = tl.program_id(0).to(tl.int64) * BLOCK
        stride = tl.num_programs(0).to(tl.int64) * BLOCK
        while step < words:
            offs = step + tl.arange(0, BLOCK)
            mask = offs < words
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)
            step += stride

    return bounded_copy_kernel


_triton_kernel = triton_kernel(_build)

"""The pointwise part of the SwiGLU expert forward: ``act = silu(h1) * h3`` from the stacked projections.

``h13 = [x @ w1, x @ w3]`` ``(S, 2F)`` comes out of one GEMM, so its halves are column slices with row stride
2F. Eager code runs ``silu`` and the product as two strided elementwise kernels (neither vectorizes over a
slice) and holds a ``(S, F)`` temporary between them. On CUDA one Triton program per row reads both halves once
and writes ``act`` (``_kernel``); elsewhere (CPU tests, CI, traced graphs) ``reference`` is the eager form.
Both round ``silu(h1)`` to the projections' dtype before the product, as the eager form does, so they agree
up to ``silu``'s last bits (Triton's ``exp`` is not libm's: a bf16 result at most two steps off).
Legend: S rows, F expert FFN width, U = 2F (gate and up stacked).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as nnf
from torch import Tensor

from relay_compile.kernels import interpreted as _interpreted
from relay_compile.kernels import triton_kernel


def reference(h13_SU: Tensor) -> Tensor:
    """Eager: ``silu(h1) * h3``; the definition the kernel is tested against."""
    ffn = h13_SU.shape[-1] // 2
    return nnf.silu(h13_SU[:, :ffn]) * h13_SU[:, ffn:]


def swiglu_forward(h13_SU: Tensor) -> Tensor:
    """``silu(h1) * h3`` ``(S, F)`` of stacked projections ``h13 (S, 2F)``, in their dtype."""
    kernel = _triton_kernel() if applies(h13_SU) else None
    if kernel is None:
        return reference(h13_SU)
    rows, ffn = h13_SU.shape[0], h13_SU.shape[-1] // 2
    act_SF = torch.empty(rows, ffn, dtype=h13_SU.dtype, device=h13_SU.device)
    if rows:
        block_f, warps = _config()
        kernel[(rows,)](h13_SU, act_SF, ffn, h13_SU.stride(0), BLOCK_F=block_f, num_warps=warps)
    return act_SF


def applies(h13_SU: Tensor) -> bool:
    """Where the kernel runs: 2-d projections of even width with unit column stride, in a floating dtype below
    fp32's width or fp32, on CUDA (or Triton's interpreter), outside of tracing (a traced graph, symbolic
    rows, takes the eager form) and of autograd (the kernel has no derivative: the ring's forward runs under its
    own backward)."""
    return (
        not h13_SU.requires_grad and (h13_SU.is_cuda or _interpreted()) and h13_SU.dim() == 2
        and h13_SU.shape[-1] % 2 == 0 and h13_SU.stride(-1) == 1
        and h13_SU.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and not torch.compiler.is_compiling() and isinstance(h13_SU.shape[0], int)
    )


# Columns per step of a row's loop: F=768 (Qwen3) is three steps of 256 (512 bytes of bf16 per load).
_BLOCK_F = 256


def _config() -> tuple[int, int]:
    """``(BLOCK_F, num_warps)``; small under the interpreter, which runs each program in numpy."""
    return (16, 1) if _interpreted() else (_BLOCK_F, 2)


def _build(triton: Any, tl: Any) -> Callable:
    """The Triton kernel (``kernels.triton_kernel`` compiles it on first use)."""

    @triton.jit
    def swiglu_forward_kernel(h13_ptr, act_ptr, ffn, stride_h, BLOCK_F: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        h_row, act_row = h13_ptr + row * stride_h, act_ptr + row * ffn
        for f0 in range(0, ffn, BLOCK_F):
            cols = f0 + tl.arange(0, BLOCK_F)
            mask = cols < ffn
            h1 = tl.load(h_row + cols, mask=mask, other=0.0).to(tl.float32)
            h3 = tl.load(h_row + ffn + cols, mask=mask, other=0.0)
            # silu rounded to the projections' dtype first: the eager form's two kernels round in between.
            silu = (h1 / (1.0 + tl.exp(-h1))).to(h3.dtype)
            act = silu.to(tl.float32) * h3.to(tl.float32)
            tl.store(act_row + cols, act.to(act_ptr.dtype.element_ty), mask=mask)

    return swiglu_forward_kernel  # named for profiles: every kernel of the package shows as its module


_triton_kernel = triton_kernel(_build)

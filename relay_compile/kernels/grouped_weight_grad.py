"""``out[e] (+)= dy_e^T @ x_e`` over rows sorted by expert, accumulated in fp32: the ring's weight gradients.

A backward hop's weight gradients are summed across hops in fp32 (``fp32_accumulation``) while its rows are
bf16. ``torch._grouped_mm`` has no fp32 output (its output dtype must be bf16), so the eager path runs one
``addmm`` with an output dtype per expert and weight (``grouped_gemm.grouped_weight_grad``): at EP=8 a hop of 16
experts is 32 GEMM dispatches plus their views, the largest share of a hop's host time that grows with the
experts it computes (the time model's ``host_hop_expert_us``). On CUDA one Triton launch per weight does the
same: a program per (expert, output tile) walks that expert's rows in blocks (bounds from the device offsets:
no host counts, no sync) and adds its fp32 tile into ``out`` (or writes it). Elsewhere (CPU tests, CI)
``reference`` computes it per expert in fp32; the kernel's logic is tested on the CPU under Triton's
interpreter. Legend: S rows sorted by expert, E experts, O/I the weight's output/input widths.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from relay_compile.kernels import interpreted as _interpreted
from relay_compile.kernels import triton_kernel


def reference(
    dy_SO: Tensor, x_SI: Tensor, offsets_E: Tensor, out_EOI: Tensor, *, accumulate: bool,
    dy_idx_S: Tensor | None = None, x_idx_S: Tensor | None = None,
) -> None:
    """Eager, one expert at a time, in ``out``'s dtype: the definition the kernel is tested against."""
    if dy_idx_S is not None:
        dy_SO = torch.index_select(dy_SO, 0, dy_idx_S)
    if x_idx_S is not None:
        x_SI = torch.index_select(x_SI, 0, x_idx_S)
    ends = offsets_E.tolist()
    for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
        part = dy_SO[start:end].t().to(out_EOI.dtype) @ x_SI[start:end].to(out_EOI.dtype)
        if accumulate:
            out_EOI[e].add_(part)
        else:
            out_EOI[e].copy_(part)


def applies(dy_SO: Tensor, x_SI: Tensor, out_dtype: torch.dtype, out_EOI: Tensor | None = None) -> bool:
    """Where the kernel runs: CUDA (or Triton's interpreter), fp32 sums (``out_dtype``) of 16-bit rows, unit column
    strides (``out_EOI``'s too, where given), Triton importable, outside of tracing (a traced graph takes the eager
    form)."""
    tensors = (dy_SO, x_SI) if out_EOI is None else (dy_SO, x_SI, out_EOI)
    return (
        (all(t.is_cuda for t in tensors) or _interpreted()) and out_dtype == torch.float32
        and dy_SO.dtype in (torch.bfloat16, torch.float16) and x_SI.dtype == dy_SO.dtype
        and all(t.stride(-1) == 1 for t in tensors) and not torch.compiler.is_compiling()
        and _triton_kernel() is not None
    )


def grouped_weight_grad_(
    dy_SO: Tensor, x_SI: Tensor, offsets_E: Tensor, out_EOI: Tensor, *, accumulate: bool,
    dy_idx_S: Tensor | None = None, x_idx_S: Tensor | None = None,
) -> None:
    """``out[e] += dy_e^T x_e`` (``accumulate``) or ``out[e] = dy_e^T x_e`` for the row groups that end at the int32
    prefix sums ``offsets_E``; one launch (``applies``), else ``reference``. ``dy_idx_S`` / ``x_idx_S``: the sorted
    rows are ``dy[dy_idx]`` / ``x[x_idx]``, read at their indices (no gathered buffer). The ring does not: ``x``
    read so ran 1.6x slower than a gather and this kernel on the gathered rows (one H100;
    docs/bench/gathered-gemm/gathered_gemm.py measures it; why is not profiled)."""
    if not applies(dy_SO, x_SI, out_EOI.dtype, out_EOI):
        reference(dy_SO, x_SI, offsets_E, out_EOI, accumulate=accumulate, dy_idx_S=dy_idx_S, x_idx_S=x_idx_S)
        return
    experts, width_o, width_i = out_EOI.shape
    block_o, block_i, block_s, warps, stages = _config(width_o, width_i)
    grid = (_cdiv(width_o, block_o) * _cdiv(width_i, block_i), experts)
    _triton_kernel()[grid](
        dy_SO, x_SI, offsets_E, out_EOI, dy_SO if dy_idx_S is None else dy_idx_S,
        x_SI if x_idx_S is None else x_idx_S, width_o, width_i, dy_SO.stride(0), x_SI.stride(0),
        out_EOI.stride(0), out_EOI.stride(1), ACCUMULATE=accumulate, GATHER_DY=dy_idx_S is not None,
        GATHER_X=x_idx_S is not None, BLOCK_O=block_o, BLOCK_I=block_i, BLOCK_S=block_s, num_warps=warps,
        num_stages=stages,
    )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# (BLOCK_O, BLOCK_I, BLOCK_S, warps, stages): 128 x 256 fp32 tiles, 64 rows a step: the fastest of the six
# tried on the H200 at the ring's hop shapes (docs/bench/h200-hop-host/).
_CONFIG = (128, 256, 64, 8, 3)


def _config(width_o: int, width_i: int) -> tuple[int, int, int, int, int]:
    if _interpreted():  # the interpreter runs each program in numpy: small tiles keep the CPU tests quick
        return (16, 16, 16, 1, 1)
    return _CONFIG


def _build(triton: Any, tl: Any) -> Callable:
    """The Triton kernel (``kernels.triton_kernel`` compiles it on first use)."""

    @triton.jit
    def grouped_weight_grad_kernel(dy_ptr, x_ptr, offs_ptr, out_ptr, dy_idx_ptr, x_idx_ptr, width_o, width_i,
                                   stride_dy, stride_x, stride_oe, stride_oo, ACCUMULATE: tl.constexpr,
                                   GATHER_DY: tl.constexpr, GATHER_X: tl.constexpr, BLOCK_O: tl.constexpr,
                                   BLOCK_I: tl.constexpr, BLOCK_S: tl.constexpr):
        tile = tl.program_id(0)
        expert = tl.program_id(1)
        tiles_i = tl.cdiv(width_i, BLOCK_I)
        cols_o = (tile // tiles_i) * BLOCK_O + tl.arange(0, BLOCK_O)
        cols_i = (tile % tiles_i) * BLOCK_I + tl.arange(0, BLOCK_I)
        mask_o, mask_i = cols_o < width_o, cols_i < width_i
        end = tl.load(offs_ptr + expert).to(tl.int64)
        start = tl.load(offs_ptr + tl.maximum(expert - 1, 0), mask=expert > 0, other=0).to(tl.int64)
        acc = tl.zeros((BLOCK_O, BLOCK_I), dtype=tl.float32)
        for s0 in range(start, end, BLOCK_S):
            rows = s0 + tl.arange(0, BLOCK_S)
            mask_s = rows < end
            dy_rows = tl.load(dy_idx_ptr + rows, mask=mask_s, other=0).to(tl.int64) if GATHER_DY else rows
            x_rows = tl.load(x_idx_ptr + rows, mask=mask_s, other=0).to(tl.int64) if GATHER_X else rows
            dy = tl.load(dy_ptr + dy_rows[:, None] * stride_dy + cols_o[None, :],
                         mask=mask_s[:, None] & mask_o[None, :], other=0.0)
            x = tl.load(x_ptr + x_rows[:, None] * stride_x + cols_i[None, :],
                        mask=mask_s[:, None] & mask_i[None, :], other=0.0)
            acc += tl.dot(tl.trans(dy), x)
        out = out_ptr + expert.to(tl.int64) * stride_oe + cols_o[:, None] * stride_oo + cols_i[None, :]
        mask = mask_o[:, None] & mask_i[None, :]
        if ACCUMULATE:
            acc += tl.load(out, mask=mask, other=0.0)
        tl.store(out, acc, mask=mask)

    return grouped_weight_grad_kernel  # named for profiles: every kernel of the package shows as its module


_triton_kernel = triton_kernel(_build)

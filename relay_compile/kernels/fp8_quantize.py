"""FP8 (E4M3) quantization of a hop's GEMM operands: rows with one scale per row, expert matrices with one scale
per expert.

``quantize_rows`` is what every FP8 hop GEMM reads on its left (``fp8_gemm``): each row ``x[s]`` becomes
``q[s] = x[s] / scale[s]`` in E4M3 with ``scale[s] = amax(|x[s]|) / 448``, optionally gathered through a
token index first (the hop's rows of ``x_TH``) or computed from a gated pair (``act(h1) * h3`` of the
recomputed projections): one pass over the rows, the input read once in its own dtype and the FP8 rows written
once. On CUDA that pass is one Triton program per row; elsewhere (CPU tests, CI) ``reference`` computes the
same values with torch ops.

``quantize_experts`` runs once per step on a rank's own weights: one scale per expert matrix (a per-tensor
scale per expert), so the transposed matrix the backward needs has the same scale and the transpose of the
FP8 bytes is exact (row-wise scales would not survive it).

Legend (docs/ARCHITECTURE.md): T tokens, S rows, D row width, E experts, O/I a matrix's output/input width.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as nnf
from torch import Tensor

from relay_compile.kernels import triton_kernel

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# Below this amax a row is taken as zero (its scale stays finite; its FP8 values are zeros).
_MIN_AMAX = 1e-12


def quantize_rows(x_TD: Tensor, tok_S: Tensor | None = None, *, gated: bool = False) -> tuple[Tensor, Tensor]:
    """``(q_SD, scale_S)``: the rows ``x[tok]`` (``tok`` None: all rows) in E4M3 with fp32 row scales.

    ``gated``: the rows are ``[h1, h3]`` pairs ``(S, 2D)`` and what is quantized is ``silu(h1) * h3`` (the
    SwiGLU activation the down projection reads), computed in fp32 in the same pass.
    """
    kernel = _triton_kernel() if _kernel_applies(x_TD, tok_S) else None
    if kernel is None:
        return reference(x_TD, tok_S, gated=gated)
    rows = x_TD.shape[0] if tok_S is None else tok_S.shape[0]
    width = x_TD.shape[1] // 2 if gated else x_TD.shape[1]
    q_SD = torch.empty((rows, width), dtype=FP8, device=x_TD.device)
    scale_S = torch.empty(rows, dtype=torch.float32, device=x_TD.device)
    if rows:
        block = max(16, 1 << (width - 1).bit_length())
        kernel[(rows,)](x_TD, x_TD if tok_S is None else tok_S, q_SD, scale_S, width, x_TD.stride(0),
                        HAS_TOK=tok_S is not None, GATED=gated, BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return q_SD, scale_S


def reference(x_TD: Tensor, tok_S: Tensor | None = None, *, gated: bool = False) -> tuple[Tensor, Tensor]:
    """Eager ``quantize_rows`` (the definition the kernel is tested against)."""
    rows = (x_TD if tok_S is None else torch.index_select(x_TD, 0, tok_S)).float()
    if gated:
        half = rows.shape[1] // 2
        rows = nnf.silu(rows[:, :half]) * rows[:, half:]
    scale_S = rows.abs().amax(dim=1).clamp(min=_MIN_AMAX) / FP8_MAX
    return (rows / scale_S[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale_S


def quantize_experts(w_EOI: Tensor) -> tuple[Tensor, Tensor]:
    """``(q_EOI, scale_E)``: each expert's matrix in E4M3 with one fp32 scale (``amax / 448``).

    The amax is a reduction without a copy (``vector_norm`` of order inf); the scaling runs on blocks of
    ``_EXPERTS_PER_BLOCK`` experts, so its fp32 working copy stays a few matrices, not the partition, in a few
    launches (this runs once per step, on the rank's own weights).
    """
    scale_E = torch.linalg.vector_norm(w_EOI, ord=float("inf"), dim=(1, 2), dtype=torch.float32)
    scale_E = scale_E.clamp_(min=_MIN_AMAX).div_(FP8_MAX)
    q_EOI = torch.empty(w_EOI.shape, dtype=FP8, device=w_EOI.device)
    for lo in range(0, w_EOI.shape[0], _EXPERTS_PER_BLOCK):
        block = slice(lo, lo + _EXPERTS_PER_BLOCK)
        q_EOI[block] = (w_EOI[block].float() / scale_E[block, None, None]).clamp_(-FP8_MAX, FP8_MAX)
    return q_EOI, scale_E


# Experts scaled per launch by ``quantize_experts`` (Qwen3's 1536 x 2048: 12 MiB of fp32 per expert).
_EXPERTS_PER_BLOCK = 4


def dequantize(q: Tensor, scale: Tensor) -> Tensor:
    """fp32 values of FP8 rows (``scale (S,)``) or expert matrices (``scale (E,)``): ``q * scale``."""
    return q.float() * scale.view(-1, *([1] * (q.dim() - 1)))


def _kernel_applies(x_TD: Tensor, tok_S: Tensor | None) -> bool:
    """CUDA, unit column stride, a contiguous index, not while tracing (a traced graph takes the eager form)."""
    return (x_TD.is_cuda and x_TD.stride(-1) == 1 and (tok_S is None or (tok_S.is_cuda and tok_S.is_contiguous()))
            and not torch.compiler.is_compiling())


def _build(triton: Any, tl: Any) -> Callable:
    """The Triton kernel (``kernels.triton_kernel`` compiles it on first use)."""

    @triton.jit
    def fp8_quantize_kernel(x_ptr, tok_ptr, q_ptr, scale_ptr, width, stride_x, HAS_TOK: tl.constexpr,
                            GATED: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        if HAS_TOK:
            src = tl.load(tok_ptr + row).to(tl.int64)
        else:
            src = row
        cols = tl.arange(0, BLOCK)
        mask = cols < width
        base = x_ptr + src * stride_x
        value = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        if GATED:
            up = tl.load(base + width + cols, mask=mask, other=0.0).to(tl.float32)
            value = value * tl.sigmoid(value) * up
        amax = tl.max(tl.abs(value), axis=0)
        scale = tl.maximum(amax, 1e-12) / 448.0
        q = tl.minimum(tl.maximum(value / scale, -448.0), 448.0)
        tl.store(q_ptr + row * width + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)

    return fp8_quantize_kernel  # named for profiles: every kernel of the package shows as its module


_triton_kernel = triton_kernel(_build)

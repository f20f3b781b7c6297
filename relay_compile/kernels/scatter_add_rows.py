"""``sum[tok[c]] += scale[c] * rows[c]`` into a wider sum (fp32 from bf16 rows): the ring's y/dx accumulation.

The sum may be stored as two row blocks (``tail``: rows ``split`` on, another allocation), as
``runtime.row_sum.RowSum`` keeps it so that its finished bf16 result reuses the first block's memory.

The ring sums a token's pairs across the hops they meet on in fp32 (``fp32_accumulation``). ``index_add_``
needs one dtype, so eager code widens the rows first: a copy of the rows in fp32, then an fp32 scatter. On
CUDA one Triton program per (row, column block) loads the row in its own dtype, scales it in registers and
adds it with fp32 atomics: one pass over the rows, no widened copy. Elsewhere (CPU tests, CI) ``reference``
widens ``WIDENED_ROWS`` rows at a time, so no widened copy of a whole hop exists either. Same result up to the
order of the fp32 additions. Legend (docs/ARCHITECTURE.md): T tokens, S rows, H hidden.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from relay_compile.kernels import triton_kernel

# Rows widened per index_add on the eager path: bounds the widened copy (8192 x H x 4 bytes).
WIDENED_ROWS = 8192


def _index_add_split_(sum_TH: Tensor, tail_TH: Tensor | None, tok_S: Tensor, rows_SH: Tensor) -> None:
    """``index_add_`` into a sum whose rows from ``len(sum_TH)`` on live in ``tail_TH``.

    Each block gets the rows of the other block as zeros (filled, not multiplied: an inf row stays out of the
    other block); no boolean indexing, so no device-to-host sync on CUDA.
    """
    if tail_TH is None:
        sum_TH.index_add_(0, tok_S, rows_SH)
        return
    split = sum_TH.shape[0]
    in_tail = (tok_S >= split)[:, None]
    sum_TH.index_add_(0, tok_S.clamp(max=split - 1), rows_SH.masked_fill(in_tail, 0))
    tail_TH.index_add_(0, (tok_S - split).clamp(min=0), rows_SH.masked_fill(~in_tail, 0))


def reference(
    sum_TH: Tensor, tok_S: Tensor, rows_SH: Tensor, scale_S1: Tensor | None = None, *, tail_TH: Tensor | None = None
) -> None:
    """Eager, a block of rows at a time; the definition the kernel is tested against."""
    for a in range(0, rows_SH.shape[0], WIDENED_ROWS):
        block = rows_SH[a : a + WIDENED_ROWS].to(sum_TH.dtype)
        if scale_S1 is not None:  # out of place: rows already in the sum's dtype are ``block`` itself
            block = block * scale_S1[a : a + WIDENED_ROWS]
        _index_add_split_(sum_TH, tail_TH, tok_S[a : a + WIDENED_ROWS], block)


def scatter_add_rows_(
    sum_TH: Tensor, tok_S: Tensor, rows_SH: Tensor, scale_S1: Tensor | None = None, *, tail_TH: Tensor | None = None
) -> None:
    """``sum[tok[c]] += scale[c] * rows[c]`` in place, in ``sum``'s dtype (``scale`` None: 1).

    ``tail_TH``: the sum's rows from ``len(sum_TH)`` on, where it is stored in two blocks (same dtype and width).
    """
    if rows_SH.dtype == sum_TH.dtype:
        _index_add_split_(sum_TH, tail_TH, tok_S, rows_SH if scale_S1 is None else rows_SH * scale_S1)
        return
    kernel = _triton_kernel() if _kernel_applies(sum_TH, tail_TH, tok_S, rows_SH, scale_S1) else None
    if kernel is None:
        reference(sum_TH, tok_S, rows_SH, scale_S1, tail_TH=tail_TH)
        return
    rows, hidden = rows_SH.shape
    if rows:
        scale = scale_S1 if scale_S1 is not None else rows_SH  # any pointer: HAS_SCALE=False never reads it
        split = sum_TH.shape[0]
        # The tail addressed from the sum's pointer (an element offset between the two allocations, which are
        # both aligned to the element size): one pointer argument, no pointer select in the kernel.
        tail_offset = 0 if tail_TH is None else (tail_TH.data_ptr() - sum_TH.data_ptr()) // sum_TH.element_size()
        grid = (rows, -(-hidden // _BLOCK_H))
        kernel[grid](sum_TH, tok_S, rows_SH, scale, hidden, sum_TH.stride(0), rows_SH.stride(0), split, tail_offset,
                     HAS_SCALE=scale_S1 is not None, BLOCK_H=_BLOCK_H, num_warps=_NUM_WARPS)


# Columns per program: H=2048 (Qwen3) is four programs per row. Every tile and warp count tried (512-2048 x 2-16)
# ran within 6% at the EP=8 65536-token chunk shapes on an H100 (its fp32 atomics, not the tile, set the time),
# this one fastest at both (137 / 263 us per 16384 / 32768 rows; docs/bench/ep8-gpu/, raw-2-h100).
_BLOCK_H = 512
_NUM_WARPS = 8


def _kernel_applies(
    sum_TH: Tensor, tail_TH: Tensor | None, tok_S: Tensor, rows_SH: Tensor, scale_S1: Tensor | None
) -> bool:
    """CUDA, an fp32 sum (and tail) of one row stride, unit column strides, outside of tracing (a traced graph
    takes the eager form)."""
    tensors = [t for t in (sum_TH, tok_S, rows_SH, scale_S1, tail_TH) if t is not None]
    return (
        sum_TH.dtype == torch.float32 and all(t.is_cuda for t in tensors) and sum_TH.stride(-1) == 1
        and (tail_TH is None or (tail_TH.dtype == sum_TH.dtype and tail_TH.stride() == sum_TH.stride()))
        and rows_SH.stride(-1) == 1 and tok_S.is_contiguous()
        and (scale_S1 is None or scale_S1.numel() == rows_SH.shape[0])
        and not torch.compiler.is_compiling()
    )


def _build(triton: Any, tl: Any) -> Callable:
    """The Triton kernel (``kernels.triton_kernel`` compiles it on first use)."""

    @triton.jit
    def scatter_add_rows_kernel(sum_ptr, tok_ptr, rows_ptr, scale_ptr, hidden, stride_sum, stride_rows, split,
                                tail_offset, HAS_SCALE: tl.constexpr, BLOCK_H: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = cols < hidden
        value = tl.load(rows_ptr + row * stride_rows + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            value = value * tl.load(scale_ptr + row).to(tl.float32)
        token = tl.load(tok_ptr + row).to(tl.int64)
        # Rows from ``split`` on live in the tail, ``tail_offset`` elements from the sum's start.
        dest = tl.where(token < split, token * stride_sum, tail_offset + (token - split) * stride_sum)
        tl.atomic_add(sum_ptr + dest + cols, value, mask=mask, sem="relaxed")

    return scatter_add_rows_kernel  # named for profiles: every kernel of the package shows as its module


_triton_kernel = triton_kernel(_build)

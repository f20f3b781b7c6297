"""The pointwise part of the SwiGLU expert backward, in place: one pass over a chunk's activations.

From ``h13 = [x @ w1, x @ w3]`` ``(S, 2F)`` and ``g = dy @ w2`` ``(S, F)`` (unscaled by the routing score):

    act     = silu(h1) * h3
    d_score = <g, act>                              per row, fp32
    g      <- score * act                           (the input of dw2's GEMM)
    h13    <- score * [g * h3 * silu'(h1), g * silu(h1)]   = [dh1, dh3] (the input of dw13's and dx's GEMMs)

In place because these are the largest buffers of a backward hop: writing the results over the inputs keeps
a hop's transient memory at ``h13 + g`` where separate outputs would double it. On CUDA one Triton program
per row streams the row through registers (``_kernel``); elsewhere (CPU tests, CI) ``reference`` computes the
same in eager ops, a block of rows at a time, and copies back. Legend: S rows, F expert FFN width, U = 2F
(gate and up stacked).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from relay_compile.kernels import triton_kernel


def reference(h13_SU: Tensor, g_SF: Tensor, score_S: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Out of place, eager: ``(score * act, dh1, dh3, d_score)``; the definition the kernel is tested against."""
    ffn = g_SF.shape[-1]
    h1, h3, g = h13_SU[:, :ffn].float(), h13_SU[:, ffn:].float(), g_SF.float()
    sig = torch.sigmoid(h1)
    silu = h1 * sig
    act = silu * h3
    d_score_S = (g * act).sum(-1)
    score = score_S.float()[:, None]
    g = g * score
    dh3 = g * silu
    dh1 = g * h3 * (sig * (1 + h1 * (1 - sig)))
    out = h13_SU.dtype
    return (act * score).to(out), dh1.to(out), dh3.to(out), d_score_S


def swiglu_backward_(h13_SU: Tensor, g_SF: Tensor, score_S: Tensor, d_score_out: Tensor | None = None,
                     dh13_out: Tensor | None = None) -> Tensor:
    """In place (see the module docstring): ``h13`` becomes ``[dh1, dh3]``, ``g`` becomes ``score * act``.

    ``d_score_out``: an fp32 ``(S,)`` tensor (a slice of the ring's per-pair score gradients) to write
    ``d_score`` into, instead of a fresh one. ``dh13_out``: ``[dh1, dh3]`` go there instead, and ``h13`` is
    only read (projections the forward saved, which the backward must not overwrite).

    Returns:
        ``d_score (S,)`` fp32 (``d_score_out`` where given).
    """
    assert h13_SU.shape[-1] == 2 * g_SF.shape[-1] and h13_SU.shape[0] == g_SF.shape[0] == score_S.shape[0]
    assert d_score_out is None or (d_score_out.shape == score_S.shape and d_score_out.dtype == torch.float32
                                   and d_score_out.is_contiguous()), "swiglu_backward_: d_score_out is (S,) fp32"
    assert dh13_out is None or (dh13_out.shape == h13_SU.shape and dh13_out.dtype == h13_SU.dtype), (
        "swiglu_backward_: dh13_out has h13's shape and dtype")
    dh13_SU = h13_SU if dh13_out is None else dh13_out
    kernel = _triton_kernel() if _eager_cuda(h13_SU, g_SF, score_S, dh13_SU) else None
    if kernel is None:
        if torch.compiler.is_compiling() or not isinstance(h13_SU.shape[0], int):
            # a traced graph: one block of any size
            d_score_S = _reference_in_place(h13_SU, g_SF, score_S, dh13_SU)
            return d_score_S if d_score_out is None else d_score_out.copy_(d_score_S)
        # Blocks of rows (each row is independent): the eager form's fp32 temporaries, about ten (rows, F)
        # buffers, would otherwise outweigh the in-place buffers themselves.
        d_score_S = _d_score_buffer(g_SF, d_score_out)
        for lo in range(0, h13_SU.shape[0], _EAGER_BLOCK_ROWS):
            hi = lo + _EAGER_BLOCK_ROWS
            d_score_S[lo:hi] = _reference_in_place(h13_SU[lo:hi], g_SF[lo:hi], score_S[lo:hi], dh13_SU[lo:hi])
        return d_score_S
    rows, ffn = g_SF.shape
    d_score_S = _d_score_buffer(g_SF, d_score_out)
    if rows:
        kernel[(rows,)](h13_SU, dh13_SU, g_SF, score_S, d_score_S, ffn, h13_SU.stride(0), dh13_SU.stride(0),
                        g_SF.stride(0), BLOCK_F=_BLOCK_F, num_warps=4)
    return d_score_S


def _d_score_buffer(g_SF: Tensor, d_score_out: Tensor | None) -> Tensor:
    return torch.empty(g_SF.shape[0], dtype=torch.float32, device=g_SF.device) if d_score_out is None else d_score_out


def _reference_in_place(h13_SU: Tensor, g_SF: Tensor, score_S: Tensor, dh13_SU: Tensor) -> Tensor:
    """``reference`` written back over ``g`` and into ``dh13`` (``h13`` itself where the caller passes it);
    returns ``d_score``."""
    act_scaled_SF, dh1_SF, dh3_SF, d_score_S = reference(h13_SU, g_SF, score_S)
    ffn = g_SF.shape[-1]
    g_SF.copy_(act_scaled_SF)
    dh13_SU[:, :ffn].copy_(dh1_SF)
    dh13_SU[:, ffn:].copy_(dh3_SF)
    return d_score_S


# Rows per block of the eager form (CPU): 512 rows of F=768 in fp32 are 1.5 MiB per temporary.
_EAGER_BLOCK_ROWS = 512

# Columns per step of a row's loop: F=768 (Qwen3) is three steps; 256 bf16 = 512 bytes per load.
_BLOCK_F = 256


def _eager_cuda(*tensors: Tensor) -> bool:
    """CUDA tensors with unit column stride, outside of tracing (a traced graph takes the eager form)."""
    return all(t.is_cuda and t.stride(-1) == 1 for t in tensors) and not torch.compiler.is_compiling()


def _build(triton: Any, tl: Any) -> Callable:
    """The Triton kernel (``kernels.triton_kernel`` compiles it on first use)."""

    @triton.jit
    def swiglu_backward_kernel(h13_ptr, dh13_ptr, g_ptr, score_ptr, d_score_ptr, ffn, stride_h, stride_dh, stride_g,
                BLOCK_F: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        h_row, dh_row, g_row = h13_ptr + row * stride_h, dh13_ptr + row * stride_dh, g_ptr + row * stride_g
        score = tl.load(score_ptr + row).to(tl.float32)
        acc = tl.zeros([BLOCK_F], dtype=tl.float32)
        for f0 in range(0, ffn, BLOCK_F):
            cols = f0 + tl.arange(0, BLOCK_F)
            mask = cols < ffn
            h1 = tl.load(h_row + cols, mask=mask, other=0.0).to(tl.float32)
            h3 = tl.load(h_row + ffn + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_row + cols, mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(h1)
            silu = h1 * sig
            act = silu * h3
            acc += g * act  # masked lanes are 0: silu(0) * 0
            g = g * score
            dh1 = g * h3 * (sig * (1 + h1 * (1 - sig)))
            tl.store(g_row + cols, (act * score).to(g_ptr.dtype.element_ty), mask=mask)
            tl.store(dh_row + cols, dh1.to(dh13_ptr.dtype.element_ty), mask=mask)
            tl.store(dh_row + ffn + cols, (g * silu).to(dh13_ptr.dtype.element_ty), mask=mask)
        tl.store(d_score_ptr + row, tl.sum(acc, axis=0))

    return swiglu_backward_kernel  # named for profiles: every kernel of the package shows as its module


_triton_kernel = triton_kernel(_build)

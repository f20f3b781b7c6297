"""The first projection of SwiGLU experts with SwiGLU itself in its epilogue, forward and backward.

The ring's SwiGLU experts compute ``h13 = x @ w13^T`` ``(S, 2F)`` (gate and up stacked) in one grouped GEMM, then a
pointwise kernel: the forward's ``act = silu(h1) * h3`` (``kernels.swiglu_forward``), the backward's
``[dh1, dh3]``, ``score * act`` and ``d_score`` from the recomputed ``h13`` and ``g = dy @ w2``
(``kernels.swiglu_backward``). ``h13`` is written by the GEMM and read back once by that kernel: at EP=8, 65536
tokens per rank, 1.6 GB each way per pass. Here one launch of ``kernels.gathered_grouped_mm``'s kernel computes a
tile of both halves (``h1``'s columns ``f`` and ``h3``'s ``F + f``) and applies the pointwise step to it in
registers: ``h13`` is never written. Its rows may be read at their indices (``idx_S``), as the gathered GEMM's.

Both round as the two-kernel forms do (each projection to the rows' dtype, as the GEMM's output is), so they
differ from them only by the GEMMs' summation order and ``exp``'s last bits. Elsewhere (CPU tests, CI, tracing)
the references run the two-kernel forms; the kernels' logic is tested on the CPU under Triton's interpreter.
Legend: T source rows, S sorted rows, E experts, K the reduced width, F the FFN width, U = 2F, N tiles of F.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relay_compile.kernels import gathered_grouped_mm as gemm
from relay_compile.kernels import swiglu_backward, swiglu_forward


def forward_reference(
    a_TK: Tensor, idx_S: Tensor | None, b_EKU: Tensor, offsets_E: Tensor, out_SF: Tensor | None = None,
    save_SU: Tensor | None = None,
) -> Tensor:
    """Eager: ``h13`` (the gathered GEMM's reference; copied into ``save_SU``'s covered rows where given), then
    ``silu(h1) * h3``, into the rows of ``out_SF`` the offsets cover (a host read of their end; a fresh tensor where
    not given, zero past them)."""
    h13_SU = _projections(a_TK, idx_S, b_EKU, offsets_E)
    end = _end(offsets_E)
    if save_SU is not None:
        save_SU[:end].copy_(h13_SU[:end])
    act_SF = swiglu_forward.reference(h13_SU)
    if out_SF is None:
        return act_SF
    out_SF[:end].copy_(act_SF[:end])
    return out_SF


def grouped_swiglu(
    a_TK: Tensor, idx_S: Tensor | None, b_EKU: Tensor, offsets_E: Tensor, out_SF: Tensor | None = None,
    config: tuple[int, int, int, int, int, int] | None = None, save_SU: Tensor | None = None,
) -> Tensor:
    """``act[s] = silu(h1[s]) * h3[s]`` ``(S, F)`` of ``h13[s] = a[idx[s]] @ b[e(s)]`` (``idx_S=None``: ``a``'s own
    rows; ``b_EKU``: ``(E, K, 2F)``, e.g. a transposed view of ``w13 (E, 2F, K)``) for the row groups that end at
    the int32 prefix sums ``offsets_E``, into ``out_SF`` (or a fresh tensor). Rows past ``offsets_E[-1]`` are not
    written (``torch._grouped_mm``'s contract: no fill for rows the ring never has). ``save_SU`` ``(S, 2F)``: the
    projections ``[h1, h3]`` stored there too (in its dtype), for a backward that reads them instead of recomputing
    them (the ring's saved projections)."""
    ffn = _ffn(b_EKU)
    idx_S = gemm.as_vector(idx_S)
    gemm.check_offsets(offsets_E, b_EKU.shape[0])
    rows = _rows(a_TK, idx_S)
    _check_shape("out_SF", out_SF, (rows, ffn))
    _check_shape("save_SU", save_SU, (rows, 2 * ffn))
    if not (gemm.applies(a_TK, b_EKU, "swiglu") and all(t is None or t.stride(-1) == 1 for t in (out_SF, save_SU))):
        return forward_reference(a_TK, idx_S, b_EKU, offsets_E, out_SF, save_SU)
    act_SF = a_TK.new_empty((rows, ffn)) if out_SF is None else out_SF
    gemm.launch(a_TK, idx_S, b_EKU, offsets_E, act_SF, ffn, "swiglu", config, save_SU=save_SU)
    return act_SF


def grouped_swiglu_backward_(
    a_TK: Tensor, idx_S: Tensor | None, b_EKU: Tensor, offsets_E: Tensor, g_SF: Tensor, score_S: Tensor,
    d_score_out: Tensor | None = None, config: tuple[int, int, int, int, int, int] | None = None,
    rows_out: Tensor | None = None, dh13_out: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """SwiGLU's backward from the recomputed projections, in the GEMM's epilogue: ``h13 = a[idx] @ b[e]`` as
    ``grouped_swiglu`` computes it, then ``kernels.swiglu_backward_``'s step (``g`` ``(S, F)`` becomes
    ``score * act`` in place). Returns ``([dh1, dh3] (S, 2F), d_score (S,) fp32)``, written into ``dh13_out`` and
    ``d_score_out`` where given. Rows past ``offsets_E[-1]``: ``dh13`` and ``g`` not written, ``d_score`` zero.
    ``rows_out`` ``(S, K)``: the rows ``a[idx]`` stored there too (``gathered_grouped_mm``'s; past the offsets not
    written)."""
    ffn = _ffn(b_EKU)
    idx_S = gemm.as_vector(idx_S)
    rows = _rows(a_TK, idx_S)
    gemm.check_offsets(offsets_E, b_EKU.shape[0])
    assert d_score_out is None or (d_score_out.shape == (rows,) and d_score_out.dtype == torch.float32
                                   and d_score_out.is_contiguous()), (
        "grouped_swiglu_backward_: d_score_out is (S,) fp32")
    _check_shape("dh13_out", dh13_out, (rows, 2 * ffn))
    assert g_SF.shape == (rows, ffn) and score_S.shape == (rows,), (
        f"grouped_swiglu_backward_: g {tuple(g_SF.shape)} and scores {tuple(score_S.shape)} must be ({rows}, {ffn})"
        f" and ({rows},)")
    if not (gemm.applies(a_TK, b_EKU, "swiglu_backward") and g_SF.stride(-1) == 1 and g_SF.dtype == a_TK.dtype
            and (dh13_out is None or dh13_out.stride(-1) == 1)):
        if rows_out is not None:
            gemm.store_rows(a_TK, idx_S, offsets_E, rows_out)
        return backward_reference_(a_TK, idx_S, b_EKU, offsets_E, g_SF, score_S, d_score_out, dh13_out)
    dh13_SU = a_TK.new_empty((rows, 2 * ffn)) if dh13_out is None else dh13_out
    block_n = (config or gemm.tile_config("swiglu_backward"))[1]
    # <g, act> per row and column tile, summed after: no atomics, the same sum on every call (zeroed: a row past
    # the offsets sums to zero, as the eager form's).
    dpart_NS = torch.zeros(-(-ffn // block_n), rows, dtype=torch.float32, device=a_TK.device)
    gemm.launch(a_TK, idx_S, b_EKU, offsets_E, dh13_SU, ffn, "swiglu_backward", config, g_SF=g_SF,
                score_S=gemm.as_vector(score_S), dpart_NS=dpart_NS, rows_out=rows_out)
    if d_score_out is None:
        return dh13_SU, dpart_NS.sum(0)
    return dh13_SU, torch.sum(dpart_NS, 0, out=d_score_out)


def backward_reference_(
    a_TK: Tensor, idx_S: Tensor | None, b_EKU: Tensor, offsets_E: Tensor, g_SF: Tensor, score_S: Tensor,
    d_score_out: Tensor | None = None, dh13_out: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Eager: ``h13``, then ``swiglu_backward_`` over it in place, on the rows the offsets cover (a host read of
    their end; the rest as the kernel leaves them, ``h13``'s zero where no ``dh13_out`` is given)."""
    h13_SU = _projections(a_TK, idx_S, b_EKU, offsets_E)
    end = _end(offsets_E)
    d_score_S = torch.zeros(h13_SU.shape[0], dtype=torch.float32, device=h13_SU.device) if d_score_out is None \
        else d_score_out.zero_()
    swiglu_backward.swiglu_backward_(h13_SU[:end], g_SF[:end], score_S[:end], d_score_S[:end])
    if dh13_out is None:
        return h13_SU, d_score_S
    dh13_out[:end].copy_(h13_SU[:end])
    return dh13_out, d_score_S


def _projections(a_TK: Tensor, idx_S: Tensor | None, b_EKU: Tensor, offsets_E: Tensor) -> Tensor:
    return gemm.reference(a_TK, idx_S, b_EKU, offsets_E, a_TK.new_zeros((_rows(a_TK, idx_S), b_EKU.shape[-1])))


def _check_shape(name: str, t: Tensor | None, shape: tuple[int, int]) -> None:
    """An output buffer the kernel writes through raw pointers: its shape is checked here, not by an index error."""
    assert t is None or tuple(t.shape) == shape, f"swiglu_gemm: {name} must be {shape}, got {tuple(t.shape)}"


def _end(offsets_E: Tensor) -> int:
    return int(offsets_E[-1]) if offsets_E.numel() else 0


def _rows(a_TK: Tensor, idx_S: Tensor | None) -> int:
    return a_TK.shape[0] if idx_S is None else idx_S.shape[0]


def _ffn(b_EKU: Tensor) -> int:
    assert b_EKU.shape[-1] % 2 == 0, f"swiglu_gemm: the projections' width {b_EKU.shape[-1]} is not two halves"
    return b_EKU.shape[-1] // 2

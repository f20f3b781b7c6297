"""Grouped GEMMs: products of rows sorted by expert with each row's own expert's weights, and their gradients.

What the expert functions (``relay_compile.experts``) are made of, on three groupings of the rows: device
offsets (``torch._grouped_mm``, one call for all experts), host counts (one GEMM per expert: the loop path, and
the fp32 weight-gradient sums, since ``torch._grouped_mm`` has no output dtype), and equal groups (batched
GEMMs, ``uniform_rows``). Per-expert biases ride on each row's expert (``expert_of_rows``); sums wider than the
rows are written by the GEMMs themselves on CUDA (``mm_widened`` / ``addmm_widened``).

Legend: S rows sorted by expert, E (or G) experts, D/I input width, O output width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from relay_compile.kernels import gathered_grouped_mm as gathered_kernel
from relay_compile.kernels import grouped_weight_grad as grouped_weight_grad_kernel
from relay_compile.kernels import swiglu_gemm
from relay_compile.kernels.scatter_add_rows import scatter_add_rows_
from relay_compile.kernels.swiglu_backward import swiglu_backward_
from relay_compile.kernels.swiglu_forward import swiglu_forward


@dataclass(frozen=True)
class GatheredRows:
    """Rows ``source[index]``, not gathered yet: the grouped GEMMs that can read rows at their indices
    (``kernels.gathered_grouped_mm``, ``kernels.grouped_weight_grad``) take them as they are, every other form
    gathers them first (``rows``). A hop's rows are its tokens' rows sorted by expert: gathered, each is an
    ``(S, D)`` buffer written once and read once more by its GEMM."""

    source_TD: Tensor
    index_S: Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.index_S.shape[0], self.source_TD.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.source_TD.dtype

    def rows(self) -> Tensor:
        return torch.index_select(self.source_TD, 0, self.index_S)


Rows = Tensor | GatheredRows


@dataclass(frozen=True)
class SumTarget:
    """Where a grouped GEMM's product rows go instead of a returned ``(S, O)`` buffer: ``sum[tok[s]] += scale[s] *
    row[s]`` into a wider (fp32) sum of one or two row blocks (``blocks()``: ``RowSum``'s head and tail)."""

    blocks: Callable[[], tuple[Tensor, Tensor | None]]
    tok_S: Tensor
    scale_S: Tensor | None = None

    def add_rows(self, y_SO: Tensor) -> None:
        """Add rows computed elsewhere (``scatter_add_rows``, which scales them in the sum's dtype, as the ring's
        unfused forward adds its output rows into a wider sum)."""
        head, tail = self.blocks()
        scatter_add_rows_(head, self.tok_S, y_SO, None if self.scale_S is None else self.scale_S[:, None],
                          tail_TH=tail)


def rows_at(x_TD: Tensor, index_S: Tensor | None) -> Rows:
    """The rows ``x[index]`` not gathered yet (``x`` itself without ``index_S``)."""
    return x_TD if index_S is None else GatheredRows(x_TD, index_S)


def gathered(x: Rows) -> Tensor:
    """``x``'s rows as a tensor (gathered where they are ``GatheredRows``)."""
    return x.rows() if isinstance(x, GatheredRows) else x


def adds_in_gemm(x_SD: Tensor, w: Tensor) -> bool:
    """Whether GEMMs of rows like ``x_SD`` by weights like ``w`` can add their products into fp32 sums in their
    epilogue (``grouped_matmul_into``): the kernel runs (CUDA, 16-bit, Triton)."""
    return gathered_kernel.applies(x_SD, w, "scatter")


def reads_at_indices(source_TD: Tensor, w: Tensor) -> bool:
    """Whether GEMMs of rows of ``source_TD`` by weights like ``w`` can read the rows at their indices: the kernels
    run (CUDA, 16-bit, Triton)."""
    return gathered_kernel.applies(source_TD, w)


def grouped_mm_supported(x: Tensor, *weights: Tensor) -> bool:
    """``torch._grouped_mm`` runs bf16 on CUDA and any float dtype in eager on CPU, on 16-byte-aligned rows."""
    aligned = all(t.shape[-1] * t.element_size() % 16 == 0 for t in (x, *weights))
    return aligned and (x.device.type == "cpu" or x.dtype == torch.bfloat16)


def grouped_linear(
    x_SD: Rows, w_EOD: Tensor, offsets_E: Tensor | None, counts_E: Sequence[int] | None
) -> Tensor:
    """``y[s] = x[s] @ w[e(s)].T`` for rows sorted by expert: one grouped GEMM, or a loop over experts."""
    return grouped_matmul(x_SD, w_EOD.transpose(-2, -1), offsets_E, counts_E)


def uniform_rows(counts_E: Sequence[int] | None) -> int:
    """The rows of each group where every one of ``counts_E`` is the same positive count, else 0.

    Equal groups run as batched GEMMs (``torch.bmm`` on the rows viewed ``(E, C, D)``): on the H200 as fast on
    the host as one ``torch._grouped_mm`` and 6% faster on the GPU at a ring chunk's shapes, and the fp32
    weight-gradient sums become one ``baddbmm`` instead of an ``addmm`` per expert (less than half the host
    time at two experts: ``docs/bench/h200-uniform/gemm_host.py``). Capacity-based dispatch gives every expert
    the same rows. On CUDA only (``batched_rows``): on the CPU nothing is gained, and the grouped GEMM's sums
    stay what they were (a capacity layer trained through the ring tracks eager to 1e-5 with them).
    """
    # Not while torch.compile traces: there the counts are SymInts of a ``.tolist()``, and the loop does not
    # branch on their values.
    if not counts_E or torch.compiler.is_compiling():
        return 0
    first = counts_E[0]
    return first if first > 0 and all(c == first for c in counts_E) else 0


def batched_rows(x: Tensor, counts_E: Sequence[int] | None) -> int:
    """``uniform_rows`` where batched GEMMs run them (CUDA), else 0."""
    return uniform_rows(counts_E) if x.is_cuda else 0


def grouped_matmul(
    x_SD: Rows, w_EDO: Tensor, offsets_E: Tensor | None, counts_E: Sequence[int] | None
) -> Tensor:
    """``y[s] = x[s] @ w[e(s)]`` for rows sorted by expert (the backward's products with the weights as they
    are stored: no transposed views made per call, each a dispatch on the host path of a hop). ``GatheredRows``
    are read at their indices over device offsets where the kernel runs, else gathered first."""
    if isinstance(x_SD, GatheredRows):
        if offsets_E is not None and gathered_kernel.applies(x_SD.source_TD, w_EDO):
            return gathered_kernel.gathered_grouped_mm(x_SD.source_TD, x_SD.index_S, w_EDO, offsets_E)
        x_SD = x_SD.rows()
    rows = batched_rows(x_SD, counts_E)
    if rows:
        return torch.bmm(x_SD.view(w_EDO.shape[0], rows, -1), w_EDO).view(x_SD.shape[0], -1)
    if offsets_E is not None:
        return torch._grouped_mm(x_SD, w_EDO, offs=offsets_E)
    assert counts_E is not None
    chunks = torch.split(x_SD, list(counts_E))
    return torch.cat([c @ w_EDO[e] for e, c in enumerate(chunks)], dim=0)


def grouped_swiglu(
    x_SD: Rows, w13_EUD: Tensor, offsets_E: Tensor | None, counts_E: Sequence[int] | None,
    save_into: Tensor | None = None,
) -> Tensor:
    """``silu(x @ w1[e].T) * (x @ w3[e].T)`` ``(S, F)`` on stacked weights ``w13 (E, 2F, D)``; ``save_into``: the
    projections ``h13`` copied there too. ``GatheredRows`` over device offsets where the kernel runs: one launch that
    reads the rows at their indices and applies SwiGLU in its epilogue (``kernels.swiglu_gemm``: the ``(S, 2F)``
    projections written only into ``save_into``); else ``grouped_linear``, then ``swiglu_forward``."""
    if isinstance(x_SD, GatheredRows) and offsets_E is not None:
        w_EDU = w13_EUD.transpose(-2, -1)
        if gathered_kernel.applies(x_SD.source_TD, w_EDU, "swiglu"):
            return swiglu_gemm.grouped_swiglu(x_SD.source_TD, x_SD.index_S, w_EDU, offsets_E, save_SU=save_into)
    h13_SU = grouped_linear(x_SD, w13_EUD, offsets_E, counts_E)
    if save_into is not None:
        save_into.copy_(h13_SU)
    return swiglu_forward(h13_SU)


def grouped_matmul_keeping_rows(
    x_SD: Rows, w_EDO: Tensor, offsets_E: Tensor | None, counts_E: Sequence[int] | None
) -> tuple[Tensor, Tensor]:
    """``(grouped_matmul(x, w), x's rows)``: ``GatheredRows`` over device offsets where the kernel runs are read at
    their indices by the GEMM, which also stores them for a later GEMM that reduces over them (a weight gradient),
    so that they are read once instead of gathered (read and written) and read again; else gathered first. Rows
    past ``offsets_E[-1]`` are not written there (the ring's chunks end at their offsets)."""
    if isinstance(x_SD, GatheredRows) and offsets_E is not None and gathered_kernel.applies(x_SD.source_TD, w_EDO):
        rows_SD = x_SD.source_TD.new_empty(x_SD.shape)
        return gathered_kernel.gathered_grouped_mm(x_SD.source_TD, x_SD.index_S, w_EDO, offsets_E,
                                                   rows_out=rows_SD), rows_SD
    rows_SD = gathered(x_SD)
    return grouped_matmul(rows_SD, w_EDO, offsets_E, counts_E), rows_SD


def grouped_swiglu_backward_(
    x_SD: Rows, w13_EUD: Tensor, offsets_E: Tensor | None, counts_E: Sequence[int] | None, g_SF: Tensor,
    score_S: Tensor, d_score_out: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """SwiGLU's backward from its recomputed first projection ``h13 = x @ w13[e].T``: ``([dh1, dh3], d_score, x's
    rows)``, ``g = dy @ w2[e]`` turned into ``score * act`` in place (``kernels.swiglu_backward``'s contract). One
    launch over device offsets where the kernel runs (``kernels.swiglu_gemm``: ``h13`` never written;
    ``GatheredRows`` read at their indices and stored for the weight gradient, as
    ``grouped_matmul_keeping_rows``), else the gathered rows' GEMM, then ``swiglu_backward_`` in place over it."""
    source, idx = (x_SD.source_TD, x_SD.index_S) if isinstance(x_SD, GatheredRows) else (x_SD, None)
    w_EDU = w13_EUD.transpose(-2, -1)
    if offsets_E is not None and gathered_kernel.applies(source, w_EDU, "swiglu_backward"):
        rows_SD = None if idx is None else source.new_empty(x_SD.shape)
        dh13_SU, d_score_S = swiglu_gemm.grouped_swiglu_backward_(
            source, idx, w_EDU, offsets_E, g_SF, score_S, d_score_out, rows_out=rows_SD)
        return dh13_SU, d_score_S, source if rows_SD is None else rows_SD
    rows_SD = gathered(x_SD)
    h13_SU = grouped_linear(rows_SD, w13_EUD, offsets_E, counts_E)
    return h13_SU, swiglu_backward_(h13_SU, g_SF, score_S, d_score_out), rows_SD


def grouped_matmul_into(
    x_SD: Rows, w_EDO: Tensor, offsets_E: Tensor | None, counts_E: Sequence[int] | None, into: SumTarget
) -> None:
    """``grouped_matmul``'s rows added into ``into`` (``sum[tok[s]] += scale[s] * y[s]``): by the GEMM's epilogue
    over device offsets where the kernel runs (fp32 atomics, no ``(S, O)`` buffer), else the product, then
    ``scatter_add_rows``."""
    head, tail = into.blocks()
    if offsets_E is not None and head.dtype == torch.float32:
        source, idx = (x_SD.source_TD, x_SD.index_S) if isinstance(x_SD, GatheredRows) else (x_SD, None)
        if gathered_kernel.applies(source, w_EDO, "scatter"):
            gathered_kernel.gathered_grouped_mm_scatter_add_(source, idx, w_EDO, offsets_E, head, into.tok_S,
                                                             into.scale_S, tail_TN=tail)
            return
    into.add_rows(grouped_matmul(x_SD, w_EDO, offsets_E, counts_E))


def expert_of_rows(offsets_G: Tensor, rows: int) -> Tensor:
    """The group (local expert of a chunk) of each of ``rows`` rows sorted by group, from the groups' int32
    prefix sums ``offsets_G`` ``(G,)``: int64 ``(rows,)``, on the device, no host sync. Computed once per chunk,
    it expands per-expert bias rows over their rows (forward) and sums each expert's rows (bias gradients)."""
    row_S = torch.arange(rows, device=offsets_G.device, dtype=offsets_G.dtype)
    return torch.searchsorted(offsets_G, row_S, right=True)


def add_bias(h_SO: Tensor, b_GO: Tensor | None, expert_S: Tensor | None) -> Tensor:
    """``h[s] + b[e(s)]``: in place unless autograd records ``h`` (the forward differentiated by the ring)."""
    if b_GO is None:
        return h_SO
    assert expert_S is not None, "a bias needs each row's expert"
    bias_SO = b_GO.index_select(0, expert_S)
    return h_SO + bias_SO if h_SO.requires_grad or b_GO.requires_grad else h_SO.add_(bias_SO)


def grouped_bias_grad(
    d_SO: Tensor, expert_S: Tensor, groups: int, grad_dtype: torch.dtype | None = None,
    into_GO: Tensor | None = None, scale_S: Tensor | None = None,
) -> Tensor:
    """``db[e] = sum of d * scale`` over the rows of expert ``e`` ``(G, O)``: the bias gradient of ``add_bias``.

    One GEMM, ``sel @ d`` with ``sel[e(s), s] = scale[s]`` (1 without ``scale_S``; in ``d``'s dtype, as the ring
    rounds the scores it multiplies ``dy`` by): deterministic (no atomics), no ``(S, O)`` product of the rows,
    summed in ``grad_dtype`` (the ring's fp32 sums) or added into ``into_GO`` in its dtype, as the weight
    gradients are (``mm_widened`` / ``addmm_widened``).
    """
    sel_GS = d_SO.new_zeros((groups, d_SO.shape[0]))
    scale = scale_S.to(d_SO.dtype) if scale_S is not None else sel_GS.new_ones(d_SO.shape[0])
    sel_GS.scatter_(0, expert_S[None, :], scale[None, :])
    if into_GO is not None:
        addmm_widened(sel_GS, d_SO, into_GO)
        return into_GO
    db_GO = d_SO.new_empty((groups, d_SO.shape[1]), dtype=grad_dtype or d_SO.dtype)
    mm_widened(sel_GS, d_SO, db_GO)
    return db_GO


def bias_score_term(dy_SH: Tensor, b2_GH: Tensor, expert_S: Tensor | None) -> Tensor:
    """``<dy[s], b2[e(s)]>`` in fp32 ``(S,)``: the down bias's part of ``d_score = <dy, out>``."""
    assert expert_S is not None, "a bias needs each row's expert"
    dots_SG = dy_SH.new_empty((dy_SH.shape[0], b2_GH.shape[0]), dtype=torch.float32)
    mm_widened(dy_SH, b2_GH.t(), dots_SG)
    return dots_SG.gather(1, expert_S[:, None]).squeeze(1)


def grouped_weight_grad(
    dy_SO: Tensor, x_SI: Tensor, offsets_E: Tensor | None, counts_E: Sequence[int] | None,
    grad_dtype: torch.dtype | None = None, into_EOI: Tensor | None = None,
) -> Tensor:
    """``dw[e] = dy_e.T @ x_e`` over the row groups ``(E, O, I)``: the weight gradient of ``grouped_linear``.

    ``grad_dtype`` wider than the rows' (fp32 for bf16 rows): each GEMM returns its fp32 accumulator
    unrounded (``torch._grouped_mm`` has no output dtype: one GEMM per expert, on the host counts
    ``counts_E``), so a partial summed across hops is rounded to the rows' dtype once, at the end.
    ``into_EOI``: add ``dw`` into it in place (in its dtype) and return it; a wider accumulator is written by
    the GEMMs themselves (``addmm`` with an output dtype), so no partial of the chunk is ever allocated. On CUDA
    an fp32 result over device offsets is one Triton launch (``kernels.grouped_weight_grad``), not a GEMM per
    expert.
    Equal groups (``uniform_rows``): one batched GEMM, whatever the dtypes. The rows come gathered: reading them at
    their indices (the kernel's ``dy_idx_S`` / ``x_idx_S``) ran 1.6x slower (docs/BENCHMARKS.md, "GEMMs that read
    their rows at the tokens' indices").
    """
    rows = batched_rows(dy_SO, counts_E)
    if rows:
        groups = len(counts_E)  # type: ignore[arg-type]
        dy_EOS, x_ESI = dy_SO.view(groups, rows, -1).transpose(1, 2), x_SI.view(groups, rows, -1)
        if into_EOI is not None:
            addmm_widened(dy_EOS, x_ESI, into_EOI)
            return into_EOI
        dw_EOI = dy_SO.new_empty((groups, dy_SO.shape[1], x_SI.shape[1]), dtype=grad_dtype or dy_SO.dtype)
        mm_widened(dy_EOS, x_ESI, dw_EOI)
        return dw_EOI
    sum_dtype = into_EOI.dtype if into_EOI is not None else grad_dtype or dy_SO.dtype
    if offsets_E is not None and grouped_weight_grad_kernel.applies(dy_SO, x_SI, sum_dtype, into_EOI):
        out_EOI = into_EOI if into_EOI is not None else dy_SO.new_empty(
            (offsets_E.shape[0], dy_SO.shape[1], x_SI.shape[1]), dtype=sum_dtype)
        # One launch for every expert's fp32 sums (CUDA).
        grouped_weight_grad_kernel.grouped_weight_grad_(dy_SO, x_SI, offsets_E, out_EOI,
                                                        accumulate=into_EOI is not None)
        return out_EOI
    if into_EOI is not None:
        if into_EOI.dtype == dy_SO.dtype and offsets_E is not None:
            return into_EOI.add_(torch._grouped_mm(dy_SO.t(), x_SI, offs=offsets_E))
        assert counts_E is not None, "a weight gradient added in place needs the host counts"
        for d_OS, x_SI_e, into_OI in _per_expert(dy_SO, x_SI, counts_E, into_EOI):
            addmm_widened(d_OS, x_SI_e, into_OI)
        return into_EOI
    if grad_dtype is None or grad_dtype == dy_SO.dtype:
        if offsets_E is not None:
            return torch._grouped_mm(dy_SO.t(), x_SI, offs=offsets_E)
        assert counts_E is not None
        counts = list(counts_E)
        return torch.stack([d.t() @ x for d, x in zip(torch.split(dy_SO, counts), torch.split(x_SI, counts))])
    assert counts_E is not None, "a weight gradient wider than its rows needs the host counts"
    dw_EOI = dy_SO.new_empty((len(counts_E), dy_SO.shape[1], x_SI.shape[1]), dtype=grad_dtype)
    for d_OS, x_SI_e, dw_OI in _per_expert(dy_SO, x_SI, counts_E, dw_EOI, skip_empty=False):
        mm_widened(d_OS, x_SI_e, dw_OI)
    return dw_EOI


def _per_expert(
    dy_SO: Tensor, x_SI: Tensor, counts_E: Sequence[int], out_EOI: Tensor, *, skip_empty: bool = True
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Each expert's ``(dy_e.T, x_e, out[e])`` for its weight-gradient GEMM: four view ops for all experts (a
    transposed split, a split, an unbind), not three per expert (a hop's host time is mostly such dispatches).
    ``skip_empty``: leave out experts without rows (their GEMM would add nothing)."""
    counts = list(counts_E)
    parts = zip(dy_SO.t().split(counts, dim=1), x_SI.split(counts), out_EOI.unbind(0), counts, strict=True)
    return [(d, x, out) for d, x, out, n in parts if n or not skip_empty]


def mm_widened(a: Tensor, b: Tensor, out: Tensor) -> None:
    """``out = a @ b`` (``mm``, or ``bmm`` for batches) accumulated in ``out``'s dtype: written by the GEMM itself
    on CUDA (an output dtype; no widened copies of the operands); elsewhere (the CPU has no GEMM with an output
    dtype) on widened copies."""
    mm = torch.mm if a.dim() == 2 else torch.bmm
    if a.dtype == out.dtype:
        mm(a, b, out=out)
    elif a.is_cuda:
        mm(a, b, out_dtype=out.dtype, out=out)
    else:
        mm(a.to(out.dtype), b.to(out.dtype), out=out)


def addmm_widened(a: Tensor, b: Tensor, acc: Tensor) -> None:
    """``acc += a @ b`` (``addmm``, or ``baddbmm`` for batches) accumulated in ``acc``'s dtype (``mm_widened``'s
    in-place sibling)."""
    batched = a.dim() == 3
    if a.is_cuda and acc.dtype != a.dtype:
        (torch.baddbmm if batched else torch.addmm)(acc, a, b, out_dtype=acc.dtype, out=acc)
        return
    if acc.dtype != a.dtype:
        a, b = a.to(acc.dtype), b.to(acc.dtype)
    (acc.baddbmm_ if batched else acc.addmm_)(a, b)


def offsets_or_counts(x_SH: Tensor, counts_L: Tensor, use_grouped_mm: bool | None, *weights: Tensor):
    """Device offsets for ``torch._grouped_mm``, or host counts for the loop over experts."""
    if use_grouped_mm is None:
        use_grouped_mm = grouped_mm_supported(x_SH, *weights)
    if use_grouped_mm:
        return torch.cumsum(counts_L, 0, dtype=torch.int32), None
    return None, counts_L.tolist()  # NOTE: device-to-host sync (the loop path only)

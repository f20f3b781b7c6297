"""Expert functions: what one ring hop calls on the (token, expert) pairs that meet there.

An expert function ``F`` is the block of an all-to-all dispatcher that runs between the two all-to-alls
(docs/ARCHITECTURE.md, section 3). The ring calls it verbatim, once per hop (or per bounded chunk of a hop):

    out_SH = F(x_SH, counts_NL, splits_N, weights)

- ``x_SH``: the rows of one (source rank, owner partition) segment, sorted by local expert ``(S, H)``.
- ``counts_NL``: int64 ``(N, E_l)`` on ``x``'s device; row ``src`` holds the rows per local expert, every other
  row is zero (the counts an owner receives from the a2a counts exchange, restricted to one source).
- ``splits_N``: host ints, rows per source rank (``counts_NL.sum(1)``); ``sum(splits_N) == S``.
- ``weights``: the visiting partition's tensors, in the order the caller passed them.

``F`` must be a pure function of its inputs (the backward recomputes it per hop) and differentiable with
respect to ``x_SH`` and ``weights``. It may carry a fused backward, ``F.vjp`` (see ``ExpertVJP``), which the
ring then uses instead of autograd.

An expert function whose weights are stacked per expert along dim 0 may also be a ``GroupedExperts``: entry
points that take the rows' grouped-GEMM offsets (precomputed per step) and weights sliced to a contiguous
range of experts. The hop loop then calls those directly, with no per-call counts arithmetic, and a bounded
chunk computes (and differentiates) only the experts it holds. ``ffn_expert_fn`` returns one.

Legend (docs/ARCHITECTURE.md): S rows of a segment, H hidden, F expert FFN width, U = 2F (gate and up
stacked), G experts of a chunk, N ranks in the EP group, E_l (L) experts per rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch
import torch.nn.functional as nnf
from torch import Tensor

from relay_compile.grouped_gemm import (
    GatheredRows,
    Rows,
    SumTarget,
    add_bias,
    adds_in_gemm,
    batched_rows,
    bias_score_term,
    expert_of_rows,
    grouped_bias_grad,
    grouped_linear,
    grouped_matmul,
    grouped_matmul_into,
    grouped_matmul_keeping_rows,
    grouped_mm_supported,
    grouped_swiglu,
    grouped_swiglu_backward_,
    grouped_weight_grad,
    offsets_or_counts,
    reads_at_indices,
    rows_at,
)
from relay_compile.kernels.swiglu_backward import swiglu_backward_
from relay_compile.kernels.swiglu_forward import swiglu_forward

ExpertFn = Callable[[Tensor, Tensor, list[int], Sequence[Tensor]], Tensor]
# ``vjp(x_SH, counts_NL, splits_N, weights, dy_SH, score_S) -> (dx_SH, d_score_S, d_weights)`` of
# ``out_SH * score_S[:, None]``: ``dx``/``d_weights`` include the score, ``d_score = <dy, out>`` per row.
ExpertVJP = Callable[
    [Tensor, Tensor, list[int], Sequence[Tensor], Tensor, Tensor], tuple[Tensor, Tensor, list[Tensor]]
]
# Called once, right before the first weight-gradient GEMM of a chunk: the accumulators, one per (packed)
# weight and shaped like the chunk's weights, that the GEMMs add into; None: return fresh gradients instead.
# The call may block (the ring's travelling sum arrives during the hop), so it comes as late as possible.
GradSink = Callable[[], Sequence[Tensor] | None]


@runtime_checkable
class GroupedExperts(Protocol):
    """Expert functions over rows grouped by expert, weights ``(G, ...)`` for the G experts of the rows.

    ``offsets_G``: int32 prefix sums of ``rows_G`` on the device; ``rows_G``: rows per expert (host ints), or
    empty where the offsets alone group the rows (the ring's chunk graphs: a captured program serves any rows per
    expert; only where ``torch._grouped_mm`` runs, and the weight gradients then come in the rows' dtype).
    ``vjp_rows`` is ``ExpertVJP`` on the rows ``x_TH[tok_S]``, ``dy_TH[tok_S]`` (it gathers them itself, so it
    can release each after its last use; ``tok_S=None``: ``x_TH`` and ``dy_TH`` are the rows themselves, as the
    ring passes rows it scaled) and is called only when ``has_fused_backward``; otherwise the ring
    differentiates ``forward_rows`` with autograd. Its weight gradients come in ``grad_dtype`` where given
    (the ring's fp32 sums: the GEMMs return their accumulators unrounded), else in the weights' dtype; or,
    where ``grad_into`` gives accumulators (``GradSink``), the weight-gradient GEMMs add into those and the
    returned list is empty. ``d_score_out`` (fp32 ``(S,)``, a slice of the ring's per-pair score gradients):
    ``d_score`` is written into it and it is returned (no buffer and copy per chunk).

    The entry points take the weights in the function's *packed* layout (``pack``: for example SwiGLU's
    ``w1`` and ``w3`` stacked, so one GEMM computes both): that is what circulates, what a chunk slices and
    what the weight gradients accumulate in, until ``unpack_grads`` hands them back in the caller's layout.

    Optional, found by ``getattr`` (``GroupedFFN`` has them): ``reads_at_indices(x_TH, weights)`` (then
    ``forward_rows`` takes ``grouped_gemm.GatheredRows`` and ``vjp_rows`` ``activation_in_gemm=True``: the
    recomputed first projection's kernel applies the activation's backward in its epilogue) and
    ``adds_in_gemm(x_TH, weights)`` (then ``forward_rows`` takes ``add_into=`` and ``vjp_rows`` ``dx_into=``, a
    ``grouped_gemm.SumTarget``, and return None for the rows they added): the options ``gather_in_gemm`` /
    ``add_in_gemm`` use them where a function has them.
    """

    has_fused_backward: bool

    def num_packed(self, num_weights: int) -> int:
        """How many tensors ``pack`` makes of ``num_weights`` (sizes the ring program without tensors)."""
        ...

    def pack(self, weights: Sequence[Tensor]) -> list[Tensor]: ...

    def unpack_grads(self, grads: Sequence[Tensor], weights: Sequence[Tensor]) -> list[Tensor]: ...

    def forward_rows(
        self, x_SH: Tensor, offsets_G: Tensor, rows_G: Sequence[int], weights: Sequence[Tensor]
    ) -> Tensor: ...

    def vjp_rows(
        self, x_TH: Tensor, tok_S: Tensor | None, offsets_G: Tensor, rows_G: Sequence[int],
        weights: Sequence[Tensor], dy_TH: Tensor, score_S: Tensor, grad_dtype: torch.dtype | None = None,
        grad_into: GradSink | None = None, d_score_out: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, list[Tensor]]: ...


def as_grouped(fn: object) -> GroupedExperts | None:
    """``fn`` where it is ``GroupedExperts``, else None: the Protocol's ``isinstance`` (~45 us: it looks up every
    member on every call, and the ring asks several times per call), with the methods checked once per type."""
    grouped = _grouped_methods(type(fn)) and hasattr(fn, "has_fused_backward")
    return fn if grouped else None  # type: ignore[return-value]


@functools.lru_cache(maxsize=None)
def _grouped_methods(cls: type) -> bool:
    return all(callable(getattr(cls, name, None))
               for name in ("num_packed", "pack", "unpack_grads", "forward_rows", "vjp_rows"))


Activation = Literal["swiglu", "geglu", "geglu_tanh", "silu", "gelu", "gelu_tanh", "relu", "relu2"]
ACTIVATIONS: tuple[str, ...] = ("swiglu", "geglu", "geglu_tanh", "silu", "gelu", "gelu_tanh", "relu", "relu2")
# Gated activations take a third weight (w3, the "up" projection): ``act(x @ w1.T) * (x @ w3.T)``.
GATED: tuple[str, ...] = ("swiglu", "geglu", "geglu_tanh")


def activation_fn(activation: str) -> Callable[[Tensor], Tensor]:
    """The pointwise function of an activation (of the gate, for gated ones)."""
    if activation in ("swiglu", "silu"):
        return nnf.silu
    if activation in ("geglu", "gelu"):
        return nnf.gelu
    if activation in ("geglu_tanh", "gelu_tanh"):
        return lambda h: nnf.gelu(h, approximate="tanh")
    if activation == "relu":
        return nnf.relu
    if activation == "relu2":
        return lambda h: nnf.relu(h).square()
    raise ValueError(f"expert_ffn: unknown activation {activation!r}; use one of {ACTIVATIONS}")


@dataclass(frozen=True)
class _Biases:
    """A chunk's packed biases: ``first`` on the first projection (``b13 (G, 2F)`` gated, ``b1 (G, F)``),
    ``down`` on the down projection ``b2 (G, H)``, and each row's expert ``expert_S`` (``expert_of_rows``)."""

    first: Tensor | None = None
    down: Tensor | None = None
    expert_S: Tensor | None = None

    def grads(
        self, dh_SO: Tensor, dy_SH: Tensor, score_S: Tensor, grad_dtype: torch.dtype | None,
        into: Sequence[Tensor | None],
    ) -> list[Tensor]:
        """``[db_first, db_down]`` (those there are): the first projection's from its pre-activation gradient
        ``dh`` (scaled by the scores already), the down projection's from ``score * dy``; added into ``into``
        (the sinks after the weights', in the same order) where given."""
        if self.first is None and self.down is None:
            return []
        assert self.expert_S is not None, "bias gradients need each row's expert"
        sinks = iter(into)
        out = []
        if self.first is not None:
            out.append(grouped_bias_grad(dh_SO, self.expert_S, self.first.shape[0], grad_dtype, next(sinks, None)))
        if self.down is not None:
            out.append(grouped_bias_grad(dy_SH, self.expert_S, self.down.shape[0], grad_dtype, next(sinks, None),
                                          score_S))
        return out


def expert_ffn_swiglu_vjp(
    x_SH: Tensor, counts_L: Tensor, w1_LFH: Tensor, w2_LHF: Tensor, w3_LFH: Tensor, dy_SH: Tensor,
    score_S: Tensor, *, use_grouped_mm: bool | None = None,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Fused backward of ``score * expert_ffn(x)`` (swiglu), recomputing only what it needs.

    ``d_score = <dy, out> = <dy @ w2, act>`` per row, so the output GEMM is not recomputed: with ``w1`` and
    ``w3`` stacked (``w13``), one recomputed GEMM (``h13``) and four gradient GEMMs (``g``, ``dw2``, ``dw13``,
    ``dx``), where autograd over a recomputed forward runs nine.

    Returns:
        ``dx (S, H)``, ``d_score (S,)`` fp32, ``[dw1, dw2, dw3]`` like the weights.
    """
    offsets_L, counts_host = offsets_or_counts(x_SH, counts_L, use_grouped_mm, w1_LFH, w2_LHF)
    w13_LUH = torch.cat([w1_LFH, w3_LFH], dim=1)
    dx_SH, d_score_S, (dw13, dw2) = _swiglu_vjp(x_SH, offsets_L, counts_host, w13_LUH, w2_LHF, dy_SH, score_S)
    dw1, dw3 = _split_w13(dw13, w2_LHF.shape[-1])
    return dx_SH, d_score_S, [dw1, dw2, dw3]


def _split_w13(w13_LUH: Tensor, ffn: int) -> list[Tensor]:
    """``[w1, w3]`` of a stacked ``w13``, as copies: with one expert the halves are contiguous views, and
    results must not alias each other (custom-op outputs)."""
    return [w13_LUH[:, :ffn].clone(memory_format=torch.contiguous_format),
            w13_LUH[:, ffn:].clone(memory_format=torch.contiguous_format)]


def _rows(x_TH: Tensor, tok_S: Tensor | None) -> Tensor:
    """The rows ``x[tok]``, gathered (``x`` itself without ``tok_S``). Gathered even where the GEMMs could read
    them at their indices: the weight gradients reduce over them, and read there ran 1.6x slower than a gather
    and the kernel on the gathered rows (docs/BENCHMARKS.md, "GEMMs that read their rows at the tokens'
    indices")."""
    return x_TH if tok_S is None else torch.index_select(x_TH, 0, tok_S)


def _recompute(
    x_TH: Tensor, dy_TH: Tensor, tok_S: Tensor | None, w_first: Tensor, w2_LHF: Tensor, offsets_L: Tensor | None,
    counts_host: Sequence[int] | None, b: _Biases, projections_SU: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """What both fused backwards start from: the rows ``dy``, ``x`` (gathered by ``tok_S`` unless given),
    ``g = dy @ w2[e]`` and the first projection ``h`` (with its bias): recomputed, or the forward's where it saved
    them (``projections_SU``, read only). Returned, not kept: the caller releases each after its last use."""
    dy_SH = _rows(dy_TH, tok_S)
    g_SF = grouped_matmul(dy_SH, w2_LHF, offsets_L, counts_host)  # dy @ w2[e]
    x_SH = _rows(x_TH, tok_S)
    if projections_SU is not None:
        return dy_SH, g_SF, x_SH, projections_SU
    return dy_SH, g_SF, x_SH, add_bias(grouped_linear(x_SH, w_first, offsets_L, counts_host), b.first, b.expert_S)


def _swiglu_vjp(
    x_TH: Tensor, offsets_L: Tensor | None, counts_host: Sequence[int] | None, w13_LUH: Tensor, w2_LHF: Tensor,
    dy_TH: Tensor, score_S: Tensor, tok_S: Tensor | None = None, grad_dtype: torch.dtype | None = None,
    rows_host: Sequence[int] | None = None, grad_into: GradSink | None = None, biases: _Biases | None = None,
    d_score_out: Tensor | None = None, projections_SU: Tensor | None = None, projections_writable: bool = False,
    dx_into: SumTarget | None = None, activation_in_gemm: bool = False,
) -> tuple[Tensor | None, Tensor, list[Tensor]]:
    """The fused SwiGLU backward on stacked weights ``w13 (E_l, 2F, H)``: ``dx``, ``d_score``, ``[dw13, dw2]``
    (then ``db13``, ``db2`` for the biases ``biases`` has). ``projections_SU``: the rows' ``h13`` as the forward
    saved them (not recomputed; not overwritten unless ``projections_writable``: else ``[dh1, dh3]`` go to a
    buffer of their own). ``dx_into``: ``dx`` is added there by its GEMM (``grouped_matmul_into``) and None is
    returned in its place. ``activation_in_gemm`` (recomputed, unbiased projections): SwiGLU's backward in the
    recomputing GEMM's epilogue (``grouped_swiglu_backward_``).

    The rows are ``x_TH[tok_S]``/``dy_TH[tok_S]`` (``tok_S=None``: ``x_TH``/``dy_TH`` themselves), gathered
    here so that each is released after its last GEMM; the pointwise step runs in place
    (``kernels.swiglu_backward``). A chunk's transient peak is ``x + dy + h13 + g`` rows. ``grad_dtype``:
    the weight gradients' dtype (``grouped_weight_grad``; needs the host row counts ``rows_host``).
    ``grad_into`` (``GradSink``): asked right before the first weight-gradient GEMM; where it gives
    accumulators ``[w13, w2]``, the GEMMs add into them and no gradients are returned.
    """
    wgrad_rows = counts_host if counts_host is not None else rows_host
    b = biases or _Biases()
    if activation_in_gemm and projections_SU is None and b.first is None:
        # Rows read at their indices by the first GEMMs, which store them for the weight gradients.
        g_SF, dy_SH = grouped_matmul_keeping_rows(rows_at(dy_TH, tok_S), w2_LHF, offsets_L, counts_host)  # dy @ w2[e]
        h13_SU, d_score_S, x_SH = grouped_swiglu_backward_(rows_at(x_TH, tok_S), w13_LUH, offsets_L, counts_host, g_SF,
                                                           score_S, d_score_out)  # h13 holds [dh1, dh3]
        dh13_out = None
    else:
        dy_SH, g_SF, x_SH, h13_SU = _recompute(x_TH, dy_TH, tok_S, w13_LUH, w2_LHF, offsets_L, counts_host, b,
                                               projections_SU)
        dh13_out = None if projections_SU is None or projections_writable else torch.empty_like(h13_SU)
        d_score_S = swiglu_backward_(h13_SU, g_SF, score_S, d_score_out, dh13_out)
    if b.down is not None:  # out = act @ w2^T + b2: <dy, out> has <dy, b2> besides <dy @ w2, act>
        d_score_S += bias_score_term(dy_SH, b.down, b.expert_S)
    act_scaled_SF, dh13_SU = g_SF, h13_SU if dh13_out is None else dh13_out
    del h13_SU
    into = grad_into() if grad_into is not None else None  # may wait for the ring's incoming sum
    into13, into2, *into_b = into if into is not None else (None, None, None, None)
    # dw2[e] = (score * dy)^T act = dy^T (score * act)
    dw2 = grouped_weight_grad(dy_SH, act_scaled_SF, offsets_L, wgrad_rows, grad_dtype, into2)
    del act_scaled_SF, g_SF
    db = b.grads(dh13_SU, dy_SH, score_S, grad_dtype, into_b)
    del dy_SH
    dw13 = grouped_weight_grad(dh13_SU, x_SH, offsets_L, wgrad_rows, grad_dtype, into13)
    del x_SH
    dx_SH = _dx(dh13_SU, w13_LUH, offsets_L, counts_host, dx_into)
    return dx_SH, d_score_S, [] if into is not None else [dw13, dw2, *db]


def _dx(
    dh_SO: Tensor, w_first: Tensor, offsets_L: Tensor | None, counts_host: Sequence[int] | None,
    into: SumTarget | None,
) -> Tensor | None:
    """``dx = dh @ w_first[e]``: returned, or added into ``into`` by its GEMM (None returned)."""
    if into is None:
        return grouped_matmul(dh_SO, w_first, offsets_L, counts_host)
    grouped_matmul_into(dh_SO, w_first, offsets_L, counts_host, into)
    return None


def _activation_backward(activation: str, grad_SF: Tensor, h_SF: Tensor) -> Tensor:
    """``grad * act'(h)`` for a non-gated activation, by aten's own backward kernels (what autograd runs)."""
    aten = torch.ops.aten
    if activation == "silu":
        return aten.silu_backward(grad_SF, h_SF)
    if activation in ("gelu", "gelu_tanh"):
        return aten.gelu_backward(grad_SF, h_SF, approximate="tanh" if activation == "gelu_tanh" else "none")
    if activation == "relu":
        return aten.threshold_backward(grad_SF, h_SF, 0)
    if activation == "relu2":
        return grad_SF * nnf.relu(h_SF).mul_(2)
    raise ValueError(f"expert_ffn: no fused backward for activation {activation!r}")


def _ffn_vjp(
    x_TH: Tensor, offsets_L: Tensor | None, counts_host: Sequence[int] | None, w1_LFH: Tensor, w2_LHF: Tensor,
    dy_TH: Tensor, score_S: Tensor, activation: str, tok_S: Tensor | None = None,
    grad_dtype: torch.dtype | None = None, rows_host: Sequence[int] | None = None, grad_into: GradSink | None = None,
    biases: _Biases | None = None, d_score_out: Tensor | None = None, projections_SU: Tensor | None = None,
    dx_into: SumTarget | None = None,
) -> tuple[Tensor | None, Tensor, list[Tensor]]:
    """The fused backward of ``score * w2 @ act(w1 @ x)`` for a non-gated activation: ``dx``, ``d_score``,
    ``[dw1, dw2]`` (then ``db1``, ``db2`` for the biases ``biases`` has; ``_swiglu_vjp``'s contract: rows
    gathered here, ``grad_into`` asked before the first weight GEMM, ``projections_SU``
    the saved ``h``, read only).

    ``d_score = <dy @ w2, act(h)>``, so the output GEMM is not recomputed: one recomputed GEMM (``h``) and four
    gradient GEMMs, where autograd over a recomputed forward runs six and keeps every intermediate.
    """
    wgrad_rows = counts_host if counts_host is not None else rows_host
    b = biases or _Biases()
    dy_SH, g_SF, x_SH, h_SF = _recompute(x_TH, dy_TH, tok_S, w1_LFH, w2_LHF, offsets_L, counts_host, b,
                                         projections_SU)
    act_SF = activation_fn(activation)(h_SF)
    d_score_S = torch.sum(g_SF.float() * act_SF.float(), -1, out=d_score_out)
    if b.down is not None:  # out = act @ w2^T + b2: <dy, out> has <dy, b2> besides <dy @ w2, act>
        d_score_S += bias_score_term(dy_SH, b.down, b.expert_S)
    score_S1 = score_S[:, None].to(g_SF.dtype)
    dh_SF = _activation_backward(activation, g_SF.mul_(score_S1), h_SF)
    del g_SF, h_SF
    act_SF.mul_(score_S1)  # dw2[e] = (score * dy)^T act = dy^T (score * act)
    into = grad_into() if grad_into is not None else None  # may wait for the ring's incoming sum
    into1, into2, *into_b = into if into is not None else (None, None, None, None)
    dw2 = grouped_weight_grad(dy_SH, act_SF, offsets_L, wgrad_rows, grad_dtype, into2)
    del act_SF
    db = b.grads(dh_SF, dy_SH, score_S, grad_dtype, into_b)
    del dy_SH
    dw1 = grouped_weight_grad(dh_SF, x_SH, offsets_L, wgrad_rows, grad_dtype, into1)
    del x_SH
    dx_SH = _dx(dh_SF, w1_LFH, offsets_L, counts_host, dx_into)
    return dx_SH, d_score_S, [] if into is not None else [dw1, dw2, *db]


def expert_ffn(
    x_SH: Tensor,
    counts_L: Tensor,
    w1_LFH: Tensor,
    w2_LHF: Tensor,
    w3_LFH: Tensor | None = None,
    *,
    activation: Activation = "swiglu",
    use_grouped_mm: bool | None = None,
) -> Tensor:
    """The experts' FFN on rows sorted by local expert, in torchtitan's weight layout.

    Args:
        x_SH: rows sorted by local expert ``(S, H)``.
        counts_L: rows per local expert ``(E_l,)``, int, on ``x``'s device; sums to S.
        w1_LFH, w3_LFH: ``(E_l, F, H)``; w3 only for ``swiglu``.
        w2_LHF: ``(E_l, H, F)``.
        use_grouped_mm: None picks ``torch._grouped_mm`` where it runs (see ``grouped_mm_supported``);
            False loops over experts, which reads the counts on the host.
            # NOTE: the loop path is a device-to-host sync.

    Returns:
        ``(S, H)``: ``w2 @ act(w1 @ x) [* (w3 @ x)]`` per row, with its own expert's weights.
    """
    offsets_L, counts_host = offsets_or_counts(x_SH, counts_L, use_grouped_mm, w1_LFH, w2_LHF)
    return _ffn(x_SH, offsets_L, counts_host, w1_LFH, w2_LHF, w3_LFH, activation)


def _ffn(
    x_SH: Rows, offsets_L: Tensor | None, counts_host: Sequence[int] | None, w1_LFH: Tensor, w2_LHF: Tensor,
    w3_LFH: Tensor | None, activation: Activation, biases: _Biases | None = None, save_into: Tensor | None = None,
    add_into: SumTarget | None = None,
) -> Tensor | None:
    """``expert_ffn`` given the grouping (device offsets, or host counts for the loop path); ``biases``
    (non-gated only): ``b1``, ``b2`` added to each row's projections; ``save_into`` (non-gated only): the first
    projection ``h`` (with its bias) is copied there, for a backward that does not recompute it."""
    b = biases or _Biases()
    act = activation_fn(activation)
    h_SF = add_bias(grouped_linear(x_SH, w1_LFH, offsets_L, counts_host), b.first, b.expert_S)
    if save_into is not None:
        save_into.copy_(h_SF)
    h_SF = act(h_SF)
    if activation in GATED:
        assert w3_LFH is not None and biases is None, f"{activation} needs w3 (and its biases packed)"
        h_SF = h_SF * grouped_linear(x_SH, w3_LFH, offsets_L, counts_host)
    return _down(h_SF, w2_LHF, offsets_L, counts_host, b, add_into)


def _down(
    h_SF: Tensor, w2_LHF: Tensor, offsets_L: Tensor | None, counts_host: Sequence[int] | None, b: _Biases,
    add_into: SumTarget | None,
) -> Tensor | None:
    """The down projection (with its bias): returned, or added into ``add_into`` by its GEMM (no bias then)."""
    if add_into is None:
        return add_bias(grouped_linear(h_SF, w2_LHF, offsets_L, counts_host), b.down, b.expert_S)
    assert b.down is None, "a down projection with a bias is returned, not added by its GEMM"
    grouped_matmul_into(h_SF, w2_LHF.transpose(-2, -1), offsets_L, counts_host, add_into)
    return None


def _gated_packed(
    x_SH: Rows, offsets_L: Tensor | None, counts_host: Sequence[int] | None, w13_LUH: Tensor, w2_LHF: Tensor,
    activation: str, biases: _Biases | None = None, save_into: Tensor | None = None,
    add_into: SumTarget | None = None,
) -> Tensor | None:
    """Gated experts on stacked weights ``w13 (E_l, 2F, H)``: one GEMM for ``h1`` and ``h3`` (their biases
    ``b13 (E_l, 2F)``, and ``b2``, added where ``biases`` has them); ``save_into``: ``h13`` is copied there;
    ``add_into``: the output rows are added there by the down projection's GEMM, and None is returned."""
    b = biases or _Biases()
    if activation == "swiglu" and b.first is None:  # SwiGLU in the first GEMM's epilogue where its kernel runs
        act_SF = grouped_swiglu(x_SH, w13_LUH, offsets_L, counts_host, save_into)
        return _down(act_SF, w2_LHF, offsets_L, counts_host, b, add_into)
    ffn = w2_LHF.shape[-1]
    h13_SU = add_bias(grouped_linear(x_SH, w13_LUH, offsets_L, counts_host), b.first, b.expert_S)
    if save_into is not None:
        save_into.copy_(h13_SU)
    if activation == "swiglu":
        h_SF = swiglu_forward(h13_SU)  # one pass over both halves (a Triton kernel on CUDA)
    else:
        h_SF = activation_fn(activation)(h13_SU[:, :ffn]) * h13_SU[:, ffn:]
    return _down(h_SF, w2_LHF, offsets_L, counts_host, b, add_into)


class GroupedFFN:
    """``expert_ffn`` as the ring's expert function: the ``ExpertFn`` contract (weights ``(w1, w2)`` or
    ``(w1, w2, w3)``, then the biases ``biases`` says there are), ``vjp`` (swiglu, no biases) and the
    ``GroupedExperts`` entry points.

    Packed layout: gated activations circulate ``[w13, w2]`` with ``w13 = cat([w1, w3], dim=1)``
    ``(E_l, 2F, H)``, so the forward runs two grouped GEMMs per chunk instead of three (swiglu's fused
    backward five instead of eight), and a hop moves two tensors (and two gradients) instead of three. Other
    activations circulate ``[w1, w2]``.

    Biases (``biases = (first, down)``): the first projection's ``b1 (E_l, F)`` (gated: ``b1, b3``, packed as
    ``b13 (E_l, 2F)``) and the down projection's ``b2 (E_l, H)`` follow the weights, in that order, unpacked
    and packed; a chunk slices them by expert like the weights, adds them to its rows by each row's expert
    (``expert_of_rows``, once per chunk) and sums their gradients per expert.
    """

    def __init__(
        self, activation: Activation = "swiglu", use_grouped_mm: bool | None = None,
        biases: tuple[bool, bool] = (False, False),
    ) -> None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"ring_moe: activation={activation!r} is not one of {ACTIVATIONS}")
        self.activation, self.use_grouped_mm, self.biases = activation, use_grouped_mm, biases
        self.__qualname__ = f"expert_ffn[{activation}{',bias' if any(biases) else ''}]"
        # Fused backward entry points: SwiGLU's (packed w13, Triton pointwise step) and the non-gated ones'.
        self.has_fused_backward = activation == "swiglu" or activation not in GATED
        if activation == "swiglu" and not any(biases):
            self.vjp: ExpertVJP = self._vjp  # the ExpertFn contract's optional fused backward

    def __call__(self, x_SH: Tensor, counts_NL: Tensor, splits_N: list[int], weights: Sequence[Tensor]) -> Tensor:
        if any(self.biases):
            counts_L = counts_NL.sum(0)
            offsets_L = torch.cumsum(counts_L, 0, dtype=torch.int32)
            return self.forward_rows(x_SH, offsets_L, counts_L.tolist(), self.pack(weights))
        return expert_ffn(
            x_SH, counts_NL.sum(0), *weights, activation=self.activation, use_grouped_mm=self.use_grouped_mm
        )

    def _vjp(
        self, x_SH: Tensor, counts_NL: Tensor, splits_N: list[int], weights: Sequence[Tensor], dy_SH: Tensor,
        score_S: Tensor,
    ) -> tuple[Tensor, Tensor, list[Tensor]]:
        w1, w2, w3 = weights
        return expert_ffn_swiglu_vjp(
            x_SH, counts_NL.sum(0), w1, w2, w3, dy_SH, score_S, use_grouped_mm=self.use_grouped_mm
        )

    def num_packed(self, num_weights: int) -> int:
        return 2 + sum(self.biases) if self.activation in GATED else num_weights

    def pack(self, weights: Sequence[Tensor]) -> list[Tensor]:
        if self.activation not in GATED:
            return list(weights)
        w1, w2, w3, *biases = weights
        packed = [torch.cat([w1, w3], dim=1), w2]
        if self.biases[0]:
            packed.append(torch.cat(biases[:2], dim=1))
        if self.biases[1]:
            packed.append(biases[-1])
        return packed

    def unpack_grads(self, grads: Sequence[Tensor], weights: Sequence[Tensor]) -> list[Tensor]:
        if self.activation not in GATED:
            return list(grads)
        dw13, dw2, *dbs = grads
        ffn = weights[1].shape[-1]
        dw1, dw3 = _split_w13(dw13, ffn)
        if self.biases[0]:
            dbs[:1] = _split_w13(dbs[0], ffn)
        return [dw1, dw2, dw3, *dbs]

    def adds_in_gemm(self, x_TH: Tensor, weights: Sequence[Tensor]) -> bool:
        """Whether this function's last GEMMs can add their rows into the ring's sums (``forward_rows(add_into=)``,
        ``vjp_rows(dx_into=)``: ``grouped_gemm.adds_in_gemm``): ``_kernels_fit``."""
        return self._kernels_fit(x_TH, weights) and adds_in_gemm(x_TH, weights[0])

    def reads_at_indices(self, x_TH: Tensor, weights: Sequence[Tensor]) -> bool:
        """Whether this function's first projection can read rows of ``x_TH`` at their indices (``forward_rows`` of
        ``GatheredRows``: ``grouped_gemm.reads_at_indices``): ``_kernels_fit``."""
        return self._kernels_fit(x_TH, weights) and reads_at_indices(x_TH, weights[0])

    def _kernels_fit(self, x_TH: Tensor, weights: Sequence[Tensor]) -> bool:
        """No biases (their products take gathered rows) and the grouped GEMM for the chunk's other GEMMs: with rows
        read at their indices every GEMM of a chunk groups its rows by the device offsets."""
        return (not any(self.biases) and self.use_grouped_mm is not False
                and grouped_mm_supported(x_TH, *weights[:2]))

    def _grouping(
        self, x_SH: Tensor, offsets_G: Tensor, rows_G: Sequence[int], weights: Sequence[Tensor]
    ) -> tuple[Tensor | None, Sequence[int] | None]:
        if not rows_G:  # the offsets alone (the ring's chunk graphs, on dtypes the grouped GEMM runs)
            return offsets_G, None
        if batched_rows(x_SH, rows_G):  # equal groups: batched GEMMs on the host counts
            return None, rows_G
        grouped = self.use_grouped_mm
        if grouped is None:
            grouped = grouped_mm_supported(x_SH, *weights[:2])
        return (offsets_G, None) if grouped else (None, rows_G)

    def _biases(self, weights: Sequence[Tensor], offsets_G: Tensor, rows: int) -> _Biases | None:
        """The packed biases of ``weights`` (after the two weights), and each of the chunk's rows' expert."""
        if not any(self.biases):
            return None
        rest = iter(weights[2:])
        first, down = (next(rest) if has else None for has in self.biases)
        return _Biases(first, down, expert_of_rows(offsets_G, rows))

    def projection_dtype(self, weights: Sequence[Tensor]) -> torch.dtype:
        """The dtype of the first projections ``forward_rows(save_into=)`` saves and ``vjp_rows(projections=)``
        reads instead of recomputing them (the packed weights'; a row's are the packed first matrix's columns:
        ``2F`` gated, else ``F``). ``weights`` in the caller's layout."""
        return weights[0].dtype

    def forward_rows(
        self, x_SH: Rows, offsets_G: Tensor, rows_G: Sequence[int], weights: Sequence[Tensor],
        save_into: Tensor | None = None, add_into: SumTarget | None = None,
    ) -> Tensor | None:
        """``GroupedExperts.forward_rows``; ``x_SH`` may be ``GatheredRows``: read at their indices by the first
        projection's GEMM where ``reads_at_indices``, else gathered here. ``add_into`` (where ``adds_in_gemm``):
        the output rows are added there by the down projection's GEMM and None is returned."""
        at_indices = isinstance(x_SH, GatheredRows) and self.reads_at_indices(x_SH.source_TD, weights)
        if isinstance(x_SH, GatheredRows) and not at_indices:
            x_SH = x_SH.rows()
        # Rows read at their indices: over the device offsets (the kernel's grouping), equal groups or not. The
        # down projection adds into ``add_into`` in its epilogue where its rows are grouped so (not batched equal
        # groups: those keep their batched GEMMs, and their rows are added after).
        grouping = (offsets_G, None) if at_indices else self._grouping(
            x_SH, offsets_G, rows_G, weights)  # type: ignore[arg-type]
        biases = self._biases(weights, offsets_G, x_SH.shape[0])
        if self.activation in GATED:
            return _gated_packed(x_SH, *grouping, weights[0], weights[1], self.activation, biases, save_into, add_into)
        return _ffn(x_SH, *grouping, weights[0], weights[1], None, self.activation, biases, save_into, add_into)

    def vjp_rows(
        self, x_TH: Tensor, tok_S: Tensor | None, offsets_G: Tensor, rows_G: Sequence[int],
        weights: Sequence[Tensor], dy_TH: Tensor, score_S: Tensor, grad_dtype: torch.dtype | None = None,
        grad_into: GradSink | None = None, d_score_out: Tensor | None = None, projections: Tensor | None = None,
        projections_writable: bool = False, dx_into: SumTarget | None = None, activation_in_gemm: bool = False,
    ) -> tuple[Tensor | None, Tensor, list[Tensor]]:
        """The fused backward of a chunk's rows (``GroupedExperts.vjp_rows``). ``projections``: the rows' saved
        first projections, read instead of recomputed; ``projections_writable``: they are this call's own copy
        (a padded chunk's gather), which the SwiGLU backward overwrites with their gradients instead of writing
        those to a buffer of their own. ``dx_into`` (where ``adds_in_gemm``): ``dx`` is added there by its GEMM
        and None is returned in its place. ``activation_in_gemm`` (where ``reads_at_indices``): SwiGLU's backward
        runs in the recomputed first projection's epilogue, and that GEMM and ``dy @ w2`` read the rows at ``tok_S``
        and store them for the weight gradients; else the rows are gathered first (``_rows``)."""
        assert self.has_fused_backward, f"expert_ffn[{self.activation}]: no fused backward"
        # dx is added by its GEMM's epilogue where the rows are grouped by the device offsets (batched equal groups
        # keep their batched GEMMs, and dx is added after).
        grouping = self._grouping(x_TH, offsets_G, rows_G, weights)
        biases = self._biases(weights, offsets_G, x_TH.shape[0] if tok_S is None else tok_S.shape[0])
        w1, w2 = weights[:2]
        if self.activation != "swiglu":
            return _ffn_vjp(x_TH, *grouping, w1, w2, dy_TH, score_S, self.activation, tok_S, grad_dtype, rows_G,
                            grad_into, biases, d_score_out, projections, dx_into)
        return _swiglu_vjp(x_TH, *grouping, w1, w2, dy_TH, score_S, tok_S, grad_dtype, rows_G, grad_into, biases,
                           d_score_out, projections, projections_writable, dx_into, activation_in_gemm)


def ffn_expert_fn(
    activation: Activation = "swiglu", use_grouped_mm: bool | None = None, biases: tuple[bool, bool] = (False, False)
) -> GroupedFFN:
    """The ring's expert function for ``expert_ffn``: weights are ``(w1, w2)`` or ``(w1, w2, w3)``, then the
    biases ``biases`` says there are (``GroupedFFN``)."""
    return GroupedFFN(activation, use_grouped_mm, biases)

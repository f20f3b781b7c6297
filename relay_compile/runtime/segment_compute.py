"""What a hop computes on the (token, expert) pairs that meet there: a segment of sorted pairs, in chunks.

``segment_forward`` and ``segment_backward`` run one hop's chunks for a ``RingStep`` (``runtime.hop_compute``,
which says whose pairs and weights meet at which hop); ``RingStepConfig`` is what they need besides tensors.

Per chunk, forward: ``y[t] += score * F(x[t])`` (scores applied after the experts), or ``y[t] += F(score * x[t])``
(``scores_before``: DeepSpeed, Megatron's ``moe_apply_probs_on_input``); backward recomputes ``F`` on the chunk,
takes its vector-Jacobian product and releases everything before the next chunk (hop-scoped rematerialization).
Scores before ``F``: with ``g = vjp_F(s x)[dy]``, ``dx += s g`` and ``d_score = <g, x>``: the backward takes
``g`` at the scaled rows (gathered and scaled in place) through the fused entry points at unit scores where ``F``
has them, else autograd, and forms ``dx`` and ``d_score`` itself.
Chunks are planned once per step (``routing.plan_chunks``); an expert function with grouped entry points
(``experts.GroupedExperts``) is called on a chunk's own experts, with weights in its packed layout: the step
packs them once, they circulate packed, and the gradients are unpacked at ``finish`` (``weight_grads``).
Sums across hops (``RingStepConfig.acc_dtype``, the ``fp32_accumulation`` option): the weight-gradient
partials that follow their weights (expert routing), the weight gradients a rank sums over hops (token
routing), and the ``y``/``dx`` accumulators (travelling in token routing, local in expert routing) are summed
in fp32, so a sum over hops is rounded to bf16 once, as an fp32-accumulating GEMM (or the CPU's index_add)
of the all-to-all layer rounds it, not once per hop. The per-pair score gradients are reduced in fp32.

On CUDA, expert routing's backward chunks of near-equal experts run padded to equal rows, as batched GEMMs
(``runtime.equal_groups``; ``HopRows.equal`` says which).

Opt-in (``chunk_graphs``): expert routing's chunks run padded to bucketed row counts through static-shape
programs, replayed as CUDA graphs (``runtime.chunk_graphs``; ``HopRows.padded`` says which).

Legend (docs/ARCHITECTURE.md): T tokens, H hidden, K top-k, S sorted rows (a hop's, or a chunk's), N ranks, E
experts, E_l = E / N.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from relay_compile.experts import ExpertFn, ExpertVJP, GroupedExperts, as_grouped
from relay_compile.grouped_gemm import GatheredRows, Rows, SumTarget
from relay_compile.routing import Chunk, PairRouting
from relay_compile.runtime import chunk_graphs
from relay_compile.runtime.chunk_graphs import PaddedChunks
from relay_compile.runtime.equal_groups import EqualGroups
from relay_compile.runtime.row_sum import RowSum
from relay_compile.runtime.transport import RingGroup
from relay_compile.runtime.weight_grads import WeightGrads

# Dtype of the per-pair score-gradient reductions (a dot product over H per pair).
ACC_DTYPE = torch.float32


@dataclass(frozen=True, kw_only=True)
class RingStepConfig:
    """What a step needs besides tensors: the expert function, the ring, and the static sizes."""

    expert_fn: ExpertFn
    ring: RingGroup
    num_experts: int
    max_hop_rows: int | None
    # Dtype of the sums across hops (module docstring); None: the dtype of the summands.
    acc_dtype: torch.dtype | None = None
    # Scores scale F's input rows (``F(s x)``) instead of its output (``s F(x)``).
    scores_before: bool = False
    # Chunks run padded to bucketed row counts as static-shape programs (``runtime.chunk_graphs``, the option
    # ``chunk_graphs``), captured as CUDA graphs where the tokens are on a CUDA device.
    chunk_graphs: bool = False
    # Backward chunks padded to equal rows per expert, run as batched GEMMs (``runtime.equal_groups``): where
    # the tokens are on CUDA.
    equal_groups: bool = False
    # A grouped expert function's forward reads a chunk's rows at the tokens' indices (the option
    # ``gather_in_gemm``), and its last GEMMs add their rows into ``y`` / ``dx`` (``add_in_gemm``), where it can.
    gather_in_gemm: bool = False
    add_in_gemm: bool = False
    # The expert function's grouped entry points, if it has them (a Protocol check is slow: once per step).
    grouped: GroupedExperts | None = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "grouped", as_grouped(self.expert_fn))

    @property
    def _paddable(self) -> bool:
        """Chunks can run padded (padding rows on token 0 with score 0): an expert function with grouped entry
        points and a fused backward, scores applied after it."""
        grouped = self.grouped
        return grouped is not None and grouped.has_fused_backward and not self.scores_before

    @property
    def pads_chunks(self) -> bool:
        """Whether a step plans padded chunks: ``chunk_graphs`` on, and ``_paddable`` (the static programs'
        contract)."""
        return self.chunk_graphs and self._paddable

    @property
    def pads_equal_groups(self) -> bool:
        """Whether a backward step pads chunks to equal groups: ``equal_groups`` on, and ``_paddable`` (what
        ``segment_backward`` pads)."""
        return self.equal_groups and self._paddable

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ring.size

    def sum_dtype(self, t: Tensor) -> torch.dtype:
        """The dtype in which sums of tensors like ``t`` run across hops (never narrower than ``t``'s)."""
        return t.dtype if self.acc_dtype is None else torch.promote_types(self.acc_dtype, t.dtype)


@dataclass(kw_only=True)
class HopActivations:
    """A hop's recomputed chunks with their autograd graphs alive (only when remat is off)."""

    chunks: list[tuple[Chunk, Tensor, list[Tensor], Tensor]] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class HopRows:
    """The rows one hop computes: a partition's sorted pairs and the chunks of them that meet here.

    ``scores_S`` and the score gradients ``ds_S`` are in sorted-pair order, so a chunk reads and writes
    plain slices ``[start, end)``; tokens come from ``routing.tokens_P``.
    """

    routing: PairRouting
    chunks: list[Chunk]
    src: int
    scores_S: Tensor
    # The step's padded chunks (``chunk_graphs``), or None.
    padded: PaddedChunks | None = None
    # The step's chunks padded to equal groups (``equal_groups``, backward), or None.
    equal: EqualGroups | None = None
    # The first projections of every pair of the step, in sorted-pair order ``(P, U)`` (``save_projections``):
    # the forward writes a chunk's rows ``[start, end)``, the backward reads them instead of recomputing. None:
    # the backward recomputes.
    projections_PU: Tensor | None = None


def _chunk_weights(cfg: RingStepConfig, weights: Sequence[Tensor], chunk: Chunk) -> list[Tensor]:
    """What ``F`` gets for a chunk: a grouped ``F`` the chunk's expert slices, any other the partition."""
    if cfg.grouped is None or chunk.whole:
        return list(weights)
    return [w[chunk.lo : chunk.hi] for w in weights]


def _expert_forward(
    cfg: RingStepConfig, chunk: Chunk, src: int, x_SH: Rows, chunk_weights: Sequence[Tensor]
) -> Tensor:
    """``F`` on one chunk: the grouped entry point, or the ``ExpertFn`` contract."""
    grouped = cfg.grouped
    if grouped is not None:
        return grouped.forward_rows(x_SH, chunk.offsets_G, chunk.rows, chunk_weights)
    return cfg.expert_fn(x_SH, _counts_NL(cfg, chunk, src), _splits_N(cfg, chunk, src), chunk_weights)


def _counts_NL(cfg: RingStepConfig, chunk: Chunk, src: int) -> Tensor:
    """The ``ExpertFn`` contract's counts: row ``src`` is the chunk's rows per local expert."""
    counts_NL = chunk.counts_L.new_zeros(cfg.ring.size, cfg.experts_per_rank)
    counts_NL[src] = chunk.counts_L
    return counts_NL


def _splits_N(cfg: RingStepConfig, chunk: Chunk, src: int) -> list[int]:
    splits_N = [0] * cfg.ring.size
    splits_N[src] = chunk.end - chunk.start
    return splits_N


def _scaled_rows(x_SH: Tensor, score_S1: Tensor) -> Tensor:
    """``s * x`` per row, as F sees it when scores come first: in fp32, cast back (torchtitan's
    ``score_before_experts``; exact for fp32)."""
    return (x_SH.to(ACC_DTYPE) * score_S1.to(ACC_DTYPE)).to(x_SH.dtype)


def _gathered_scaled_rows(x_TH: Tensor, tok_S: Tensor, score_S1: Tensor) -> Tensor:
    """``_scaled_rows(x[tok], s)`` without a second ``(S, H)`` buffer: the gather is scaled in place (the product
    is computed in fp32 and rounded once into the rows' dtype, as ``_scaled_rows`` rounds it)."""
    return torch.index_select(x_TH, 0, tok_S).mul_(score_S1.to(ACC_DTYPE))


def _row_dot(a_SH: Tensor, b_SH: Tensor) -> Tensor:
    """``<a[c], b[c]>`` per row in fp32, ``(S,)``, without an elementwise ``(S, H)`` product."""
    return torch.bmm(a_SH.to(ACC_DTYPE).unsqueeze(1), b_SH.to(ACC_DTYPE).unsqueeze(2)).view(-1)


def segment_forward(
    cfg: RingStepConfig, rows: HopRows, x_TH: Tensor, weights: Sequence[Tensor], y: RowSum
) -> None:
    """``y[t] += scores[p] * F_owner(x[t])`` (or ``F_owner(scores[p] * x[t])``) for the pairs ``p = (t, k)`` of
    the hop's chunks."""
    at_indices = _reads_at_indices(cfg, x_TH, weights)
    adds = _adds_in_gemm(cfg, x_TH, weights, y)
    for chunk in rows.chunks:
        padded = rows.padded.of(chunk) if rows.padded is not None else None
        if padded is not None:
            assert cfg.grouped is not None and rows.padded is not None
            chunk_graphs.forward(cfg.grouped, rows.padded, padded, x_TH, _chunk_weights(cfg, weights, chunk), y.add_)
            continue
        tok_S = rows.routing.tokens_P[chunk.start : chunk.end]
        score_S1 = rows.scores_S[chunk.start : chunk.end, None]
        if cfg.scores_before:
            x_SH: Rows = _gathered_scaled_rows(x_TH, tok_S, score_S1)
        else:
            x_SH = GatheredRows(x_TH, tok_S) if at_indices else torch.index_select(x_TH, 0, tok_S)
        if adds:  # the down projection's GEMM adds score * out into y
            assert cfg.grouped is not None
            saved = None if rows.projections_PU is None else rows.projections_PU[chunk.start : chunk.end]
            cfg.grouped.forward_rows(x_SH, chunk.offsets_G, chunk.rows, _chunk_weights(cfg, weights, chunk),
                                     save_into=saved, add_into=SumTarget(y.blocks, tok_S, score_S1[:, 0]))
            continue
        if rows.projections_PU is not None:  # the step checked: grouped experts, scores after them
            assert cfg.grouped is not None
            out_SH = cfg.grouped.forward_rows(x_SH, chunk.offsets_G, chunk.rows, _chunk_weights(cfg, weights, chunk),
                                              save_into=rows.projections_PU[chunk.start : chunk.end])
        else:
            out_SH = _expert_forward(cfg, chunk, rows.src, x_SH, _chunk_weights(cfg, weights, chunk))
        if cfg.scores_before:
            y.add_(tok_S, out_SH)
        elif cfg.grouped is not None and out_SH.dtype == y.dtype:
            out_SH.mul_(score_S1)  # our own expert function's fresh output: scale it in place
            y.add_(tok_S, out_SH)
        else:
            y.add_(tok_S, out_SH, score_S1)


def _reads_at_indices(cfg: RingStepConfig, x_TH: Tensor, weights: Sequence[Tensor]) -> bool:
    """Whether the forward hands its chunks' rows to the expert function as ``GatheredRows`` (read at their
    indices by its GEMMs, no gathered buffer): a grouped function that can (``reads_at_indices``), scores after it."""
    reads = getattr(cfg.grouped, "reads_at_indices", None)
    return cfg.gather_in_gemm and reads is not None and not cfg.scores_before and reads(x_TH, weights)


def _adds_in_gemm(cfg: RingStepConfig, x_TH: Tensor, weights: Sequence[Tensor], sum_TH: RowSum) -> bool:
    """Whether a hop's last GEMMs add their rows into ``sum_TH`` (``y`` or ``dx``) in their epilogue: a grouped
    function that can (``adds_in_gemm``), scores after it, a sum held here (token routing's arriving sums are
    waited for at their first add, which would then come before the GEMM instead of after it), in fp32 (the
    kernel's atomics)."""
    adds = getattr(cfg.grouped, "adds_in_gemm", None)
    return (cfg.add_in_gemm and adds is not None and not cfg.scores_before and sum_TH.here
            and sum_TH.dtype == torch.float32 and adds(x_TH, weights))


@contextlib.contextmanager
def _autograd_enabled() -> Iterator[None]:
    """Record autograd graphs inside a custom op's kernel.

    A custom op whose inputs need no grad runs below the Autograd dispatch keys (custom_op's
    ``_AutoDispatchBelowAutograd``), where ``enable_grad`` alone records nothing; the backward hop needs a
    graph of ``F`` to take its vector-Jacobian product.
    """
    c = torch._C
    exclude = c._dispatch_tls_local_exclude_set()
    for key in (c.DispatchKey.AutogradFunctionality, c.DispatchKey.AutogradOther, c.DispatchKey.AutogradNestedTensor):
        exclude = exclude.remove(key)
    with c._ForceDispatchKeyGuard(c._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


def recompute_chunk(
    cfg: RingStepConfig, rows: HopRows, chunk: Chunk, x_TH: Tensor, weights: Sequence[Tensor]
) -> tuple[Chunk, Tensor, list[Tensor], Tensor]:
    """Rerun ``F`` on one chunk with autograd: ``(chunk, rows leaf, weight leaves, out_SH)``.

    The rows leaf is ``x[tok]``, or with scores before ``F`` the scaled rows ``u = s x[tok]`` (scaled in place,
    outside autograd: ``chunk_vjp`` turns ``vjp_F(u)`` into ``dx`` and ``d_score`` itself). Weight leaves: the
    chunk's expert slices (grouped ``F``) or whole partitions.
    """
    tok_S = rows.routing.tokens_P[chunk.start : chunk.end]
    if cfg.scores_before:
        x_SH = _gathered_scaled_rows(x_TH, tok_S, rows.scores_S[chunk.start : chunk.end, None]).requires_grad_()
    else:
        x_SH = torch.index_select(x_TH, 0, tok_S).detach().requires_grad_()
    w_leaves = [w.detach().requires_grad_() for w in _chunk_weights(cfg, weights, chunk)]
    with _autograd_enabled():
        out_SH = _expert_forward(cfg, chunk, rows.src, x_SH, w_leaves)
    return chunk, x_SH, w_leaves, out_SH


def chunk_vjp(
    cfg: RingStepConfig, rows: HopRows, pending: list[tuple[Chunk, Tensor, list[Tensor], Tensor]],
    x_TH: Tensor, dy_TH: Tensor, dx: RowSum, ds_S: Tensor, dw: WeightGrads,
) -> None:
    """Consume the first recomputed chunk of ``pending``: add its ``dx``, ``d_scores`` and weight-gradient
    contributions. It is popped, so its rows and output are released here as soon as they are used."""
    chunk, x_SH, w_leaves, out_SH = pending.pop(0)
    tok_S = rows.routing.tokens_P[chunk.start : chunk.end]
    dy_SH = torch.index_select(dy_TH, 0, tok_S)
    if cfg.scores_before:  # x_SH is u = s x: with g = vjp_F(u)[dy], dx = s g and d_score = <g, x>
        with _autograd_enabled():
            g_SH, *dws = torch.autograd.grad(out_SH, [x_SH, *w_leaves], dy_SH, allow_unused=True)
        del out_SH, dy_SH, x_SH
        if g_SH is None:  # F ignores its rows
            ds_S[chunk.start : chunk.end] = 0
        else:
            ds_S[chunk.start : chunk.end] = _row_dot(g_SH, torch.index_select(x_TH, 0, tok_S))
            # autograd's fresh gradient rows (or our own dy gather): scaled in place, rounded once as autograd's
            dx.add_(tok_S, g_SH.mul_(rows.scores_S[chunk.start : chunk.end, None].to(ACC_DTYPE)))
        dw.add(dws, chunk if cfg.grouped is not None else None)
        return
    ds_S[chunk.start : chunk.end] = _row_dot(dy_SH, out_SH.detach())
    # dy_SH is this chunk's own gather: scaled in place (as dy * s rounds it), not copied.
    dy_SH.mul_(rows.scores_S[chunk.start : chunk.end, None].to(dy_SH.dtype))
    with _autograd_enabled():
        grads = list(torch.autograd.grad(out_SH, [x_SH, *w_leaves], dy_SH, allow_unused=True))
    dx.add_(tok_S, grads[0])
    dw.add(grads[1:], chunk if cfg.grouped is not None else None)


def segment_backward(
    cfg: RingStepConfig, rows: HopRows, x_TH: Tensor, weights: Sequence[Tensor], dy_TH: Tensor,
    dx: RowSum, ds_S: Tensor, dw: WeightGrads,
) -> None:
    """Per chunk: recompute, vector-Jacobian product, accumulate, release.

    Uses the expert function's fused backward where it has one (``vjp_rows``, else ``vjp``), else autograd
    over a recomputed forward. With scores before ``F`` the fused backward runs on the scaled rows
    (``_scores_before_fused_vjp``).
    """
    grouped = cfg.grouped
    fused = getattr(cfg.expert_fn, "vjp", None)
    no_fused = (grouped is None and fused is None) or (grouped is not None and not grouped.has_fused_backward)
    adds = not no_fused and _adds_in_gemm(cfg, x_TH, weights, dx)
    # Under ``gather_in_gemm`` the backward's first GEMMs (``g = dy @ w2``, the recomputed first projection with the
    # activation's backward in its epilogue: ``activation_in_gemm``) read the rows at their indices and store them
    # for the weight gradients, which reduce over them from that buffer: read at their indices the weight
    # gradients ran 1.6x slower than on gathered rows (dw13 at EP=8 65536 tokens, one H100: 1417 against 866 us;
    # docs/bench/gathered-gemm/raw-1-h100: the ring's backward 33.3 -> 45.8 ms with them).
    in_gemm = {"activation_in_gemm": True} if not no_fused and _reads_at_indices(cfg, x_TH, weights) else {}
    for chunk in rows.chunks:
        if no_fused:
            chunk_vjp(cfg, rows, [recompute_chunk(cfg, rows, chunk, x_TH, weights)], x_TH, dy_TH, dx, ds_S, dw)
            continue
        if cfg.scores_before:
            _scores_before_fused_vjp(cfg, rows, chunk, x_TH, weights, dy_TH, dx, ds_S, dw, fused)
            continue
        padded = rows.padded.of(chunk) if rows.padded is not None else None
        if padded is not None:
            _padded_vjp(cfg, rows, chunk, padded, x_TH, weights, dy_TH, dx, ds_S, dw)
            continue
        equal = rows.equal.of(chunk) if rows.equal is not None else None
        saved = rows.projections_PU
        if equal is not None:  # padded to equal groups: the padded rows' tokens, scores and score gradients
            assert rows.equal is not None
            q0, q1 = equal.start, equal.end
            equal_rows = slice(q0, q1)
            tok_S, chunk_score_S = rows.equal.tok_Q[equal_rows], rows.equal.score_Q[equal_rows]
            chunk_ds_S = rows.equal.ds_Q[equal_rows]
            offsets_G, rows_G = equal.offsets_G, (equal.rows,) * equal.groups
            chunk_saved = None if saved is None else _padded_projections(saved, rows.equal.pos_Q[equal_rows])
        else:
            c0, c1 = chunk.start, chunk.end
            tok_S, chunk_score_S, chunk_ds_S = rows.routing.tokens_P[c0:c1], rows.scores_S[c0:c1], ds_S[c0:c1]
            offsets_G, rows_G = chunk.offsets_G, chunk.rows
            chunk_saved = None if saved is None else saved[c0:c1]
        if grouped is not None:
            chunk_weights = _chunk_weights(cfg, weights, chunk)
            # The score gradients are written in place into the step's (no buffer and copy per chunk).
            dx_SH, ds_out, dws = grouped.vjp_rows(
                x_TH, tok_S, offsets_G, rows_G, chunk_weights, dy_TH, chunk_score_S,
                grad_dtype=cfg.sum_dtype(dw.weights[0]), grad_into=functools.partial(dw.sink, chunk),
                d_score_out=chunk_ds_S,
                # A padded chunk's projections are its own gather: overwritten by their gradients, no second buffer.
                **({} if chunk_saved is None else {"projections": chunk_saved,
                                                   "projections_writable": equal is not None}),
                **({"dx_into": SumTarget(dx.blocks, tok_S)} if adds else {}), **in_gemm,
            )
        else:
            dx_SH, ds_out, dws = fused(
                torch.index_select(x_TH, 0, tok_S), _counts_NL(cfg, chunk, rows.src), _splits_N(cfg, chunk, rows.src),
                weights, torch.index_select(dy_TH, 0, tok_S), chunk_score_S,
            )
        if ds_out is not chunk_ds_S:
            chunk_ds_S.copy_(ds_out)
        if dx_SH is not None:  # else its GEMM added it
            dx.add_(tok_S, dx_SH)
        if dws:  # else the GEMMs added them into ``dw.sink(chunk)``
            dw.add(dws, chunk if grouped is not None else None)


def _padded_projections(saved_PU: Tensor, pos_Q: Tensor) -> Tensor:
    """A padded chunk's saved first projections, row for row with its padded rows (``EqualGroups.pos_Q``: each
    row's sorted pair, ``P`` for padding), in a copy of their own. A padding row takes pair ``P - 1``'s (written:
    every pair meets its expert on one hop): any finite row does, since its score is 0, so everything it adds to
    ``dx`` and to the weight and bias gradients is exactly zero (its score gradient goes to the padding slot)."""
    return torch.index_select(saved_PU, 0, pos_Q.clamp(max=saved_PU.shape[0] - 1))


def _padded_vjp(
    cfg: RingStepConfig, rows: HopRows, chunk: Chunk, padded: chunk_graphs.PaddedChunk, x_TH: Tensor,
    weights: Sequence[Tensor], dy_TH: Tensor, dx: RowSum, ds_S: Tensor, dw: WeightGrads,
) -> None:
    """One padded chunk's backward through its static program (``chunk_graphs.backward``): ``dx`` scattered,
    the pairs' score gradients copied, the weight gradients added into the sums (in their dtype), or kept as a
    copy in it where they start them (the next chunk's program overwrites its buffers)."""
    assert cfg.grouped is not None and rows.padded is not None
    tok_S, dx_SH, chunk_ds_S, dws = chunk_graphs.backward(
        cfg.grouped, rows.padded, padded, x_TH, _chunk_weights(cfg, weights, chunk), dy_TH)
    ds_S[padded.first : padded.first + padded.real] = chunk_ds_S[: padded.real]
    dx.add_(tok_S, dx_SH)
    sinks = dw.sink(chunk)  # may wait for the ring's incoming sums: after the chunk's compute
    if sinks is None:
        dw.add([g.to(cfg.sum_dtype(g), copy=True) for g in dws], chunk)
        return
    for acc, g in zip(sinks, dws, strict=True):
        acc.add_(g)


def _scores_before_fused_vjp(
    cfg: RingStepConfig, rows: HopRows, chunk: Chunk, x_TH: Tensor, weights: Sequence[Tensor], dy_TH: Tensor,
    dx: RowSum, ds_S: Tensor, dw: WeightGrads, vjp: ExpertVJP | None,
) -> None:
    """One chunk's backward of ``y[t] += F(s x[t])`` through the fused backward of ``s' F(u)`` at ``s' = 1``
    (``cfg.grouped``'s ``vjp_rows``, else the expert function's ``vjp``).

    The fused entry points differentiate ``score * F(rows)``: on the scaled rows ``u = s x`` with unit scores
    they return ``g = vjp_F(u)[dy]`` and ``F``'s weight gradients at ``u``; then ``dx += s g`` (scaled while
    scattered) and ``d_s = <g, x>`` (a row dot in fp32). The gradient rows of the scaled rows are the
    only extra ``(S, H)`` buffer beside what the scores-after path holds; autograd over a recomputed forward
    held the leaf, the product, every intermediate of ``F`` and their gradients at once.
    """
    c0, c1 = chunk.start, chunk.end
    tok_S = rows.routing.tokens_P[c0:c1]
    score_S1 = rows.scores_S[c0:c1, None]
    unit_S = score_S1.new_ones(c1 - c0, dtype=ACC_DTYPE)
    grouped = cfg.grouped
    if grouped is not None:
        chunk_weights = _chunk_weights(cfg, weights, chunk)
        # tok_S=None: the rows are given (gathered and scaled here); the entry point drops them after use.
        g_SH, _, dws = grouped.vjp_rows(
            _gathered_scaled_rows(x_TH, tok_S, score_S1), None, chunk.offsets_G, chunk.rows, chunk_weights,
            torch.index_select(dy_TH, 0, tok_S), unit_S, grad_dtype=cfg.sum_dtype(dw.weights[0]),
            grad_into=functools.partial(dw.sink, chunk),
        )
    else:
        assert vjp is not None, "hop_compute: no fused backward for scores before the experts"
        g_SH, _, dws = vjp(
            _gathered_scaled_rows(x_TH, tok_S, score_S1), _counts_NL(cfg, chunk, rows.src),
            _splits_N(cfg, chunk, rows.src), weights, torch.index_select(dy_TH, 0, tok_S), unit_S,
        )
    ds_S[c0:c1] = _row_dot(g_SH, torch.index_select(x_TH, 0, tok_S))
    if grouped is not None:  # our own entry point's fresh rows: scale them in place (rounded once, as autograd's)
        dx.add_(tok_S, g_SH.mul_(score_S1.to(ACC_DTYPE)))
    else:
        dx.add_(tok_S, g_SH, score_S1.to(g_SH.dtype))
    if dws:  # else the GEMMs added them into ``dw.sink(chunk)``
        dw.add(dws, chunk if grouped is not None else None)

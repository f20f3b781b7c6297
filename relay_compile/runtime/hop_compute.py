"""What one hop computes: the (token, expert) pairs that meet on this rank, in bounded chunks.

A ``RingStep`` binds one call of the ring (one forward or one backward of one MoE block) to the ring
programs: the programs say *when* (hop order, transfers), the step says *what* (which pairs, which rows).

- ``ExpertRoutingStep``: tokens stay; at hop ``h`` rank ``r`` holds the weights of owner ``(r - h) mod N`` and
  computes its own pairs for that owner. Backward sums the owner's weight gradients one hop behind the
  weights: hop 0 starts the sum, every later hop's GEMMs add into the sum arriving from the previous rank
  (``backward_hop_into``; the program pass ``sum_in_place``), so no hop holds a partial beside it.
- ``TokenRoutingStep``: experts stay; at hop ``h`` rank ``r`` holds the tokens of source ``(r - h) mod N`` and
  computes their pairs for its own experts. The output (backward: ``dx``, ``d_scores``) accumulator travels
  one hop behind the tokens; weight gradients accumulate locally.

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

A step plans from counts every rank agreed on (``runtime.agreement``; a step driven directly on a ring of
one counts its own). Inside a multi-rank ``transport.RingRun`` the step never raises out of a hop: the
first exception marks the run failed, and its setup, hops and ``finish`` then return zeros of the
partials' shapes without computing, so the program completes every transfer (``_guarded``).

Legend: T tokens, H hidden, K top-k, P = T*K pairs, C rows of a chunk, N ranks, E experts, E_l = E / N.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor

from relay_compile.experts import ExpertFn, ExpertVJP, GroupedExperts
from relay_compile.kernels.scatter_add_rows import scatter_add_rows_
from relay_compile.routing import Chunk, PairRouting, plan_chunks, split_experts
from relay_compile.runtime.agreement import StepCounts, raise_bad_ids
from relay_compile.runtime.transport import RingGroup, RingTransfer, active_run
from relay_compile.runtime.weight_grads import WeightGrads, pack_weights, unpack_grads

_Method = TypeVar("_Method", bound=Callable[..., Any])

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
    # The expert function's grouped entry points, if it has them (a Protocol check is slow: once per step).
    grouped: GroupedExperts | None = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "grouped", self.expert_fn if isinstance(self.expert_fn, GroupedExperts) else None)

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


def _chunk_weights(cfg: RingStepConfig, weights: Sequence[Tensor], chunk: Chunk) -> list[Tensor]:
    """What ``F`` gets for a chunk: a grouped ``F`` the chunk's expert slices, any other the partition."""
    if cfg.grouped is None or chunk.whole:
        return list(weights)
    return [w[chunk.lo : chunk.hi] for w in weights]


def _expert_forward(
    cfg: RingStepConfig, chunk: Chunk, src: int, x_CH: Tensor, chunk_weights: Sequence[Tensor]
) -> Tensor:
    """``F`` on one chunk: the grouped entry point, or the ``ExpertFn`` contract."""
    grouped = cfg.grouped
    if grouped is not None:
        return grouped.forward_rows(x_CH, chunk.offsets_G, chunk.rows, chunk_weights)
    return cfg.expert_fn(x_CH, _counts_NL(cfg, chunk, src), _splits_N(cfg, chunk, src), chunk_weights)


def _counts_NL(cfg: RingStepConfig, chunk: Chunk, src: int) -> Tensor:
    """The ``ExpertFn`` contract's counts: row ``src`` is the chunk's rows per local expert."""
    counts_NL = chunk.counts_L.new_zeros(cfg.ring.size, cfg.experts_per_rank)
    counts_NL[src] = chunk.counts_L
    return counts_NL


def _splits_N(cfg: RingStepConfig, chunk: Chunk, src: int) -> list[int]:
    splits_N = [0] * cfg.ring.size
    splits_N[src] = chunk.end - chunk.start
    return splits_N


def _scaled_rows(x_CH: Tensor, score_C1: Tensor) -> Tensor:
    """``s * x`` per row, as F sees it when scores come first: in fp32, cast back (torchtitan's
    ``score_before_experts``; exact for fp32)."""
    return (x_CH.to(ACC_DTYPE) * score_C1.to(ACC_DTYPE)).to(x_CH.dtype)


def _gathered_scaled_rows(x_TH: Tensor, tok_C: Tensor, score_C1: Tensor) -> Tensor:
    """``_scaled_rows(x[tok], s)`` without a second ``(C, H)`` buffer: the gather is scaled in place (the product
    is computed in fp32 and rounded once into the rows' dtype, as ``_scaled_rows`` rounds it)."""
    return x_TH[tok_C].mul_(score_C1.to(ACC_DTYPE))


def _row_dot(a_CH: Tensor, b_CH: Tensor) -> Tensor:
    """``<a[c], b[c]>`` per row in fp32, ``(C,)``, without an elementwise ``(C, H)`` product."""
    return torch.bmm(a_CH.to(ACC_DTYPE).unsqueeze(1), b_CH.to(ACC_DTYPE).unsqueeze(2)).view(-1)


def segment_forward(
    cfg: RingStepConfig, rows: HopRows, x_TH: Tensor, weights: Sequence[Tensor], y_TH: Tensor
) -> None:
    """``y[t] += scores[p] * F_owner(x[t])`` (or ``F_owner(scores[p] * x[t])``) for the pairs ``p = (t, k)`` of
    the hop's chunks."""
    for chunk in rows.chunks:
        tok_C = rows.routing.tokens_P[chunk.start : chunk.end]
        score_C1 = rows.scores_S[chunk.start : chunk.end, None]
        x_CH = _gathered_scaled_rows(x_TH, tok_C, score_C1) if cfg.scores_before else x_TH[tok_C]
        out_CH = _expert_forward(cfg, chunk, rows.src, x_CH, _chunk_weights(cfg, weights, chunk))
        if cfg.scores_before:
            scatter_add_rows_(y_TH, tok_C, out_CH)
        elif cfg.grouped is not None and out_CH.dtype == y_TH.dtype:
            out_CH.mul_(score_C1)  # our own expert function's fresh output: scale it in place
            y_TH.index_add_(0, tok_C, out_CH)
        else:
            scatter_add_rows_(y_TH, tok_C, out_CH, score_C1)


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


def _recompute_chunk(
    cfg: RingStepConfig, rows: HopRows, chunk: Chunk, x_TH: Tensor, weights: Sequence[Tensor]
) -> tuple[Chunk, Tensor, list[Tensor], Tensor]:
    """Rerun ``F`` on one chunk with autograd: ``(chunk, rows leaf, weight leaves, out_CH)``.

    The rows leaf is ``x[tok]``, or with scores before ``F`` the scaled rows ``u = s x[tok]`` (scaled in place,
    outside autograd: ``_chunk_vjp`` turns ``vjp_F(u)`` into ``dx`` and ``d_score`` itself). Weight leaves: the
    chunk's expert slices (grouped ``F``) or whole partitions.
    """
    tok_C = rows.routing.tokens_P[chunk.start : chunk.end]
    if cfg.scores_before:
        x_CH = _gathered_scaled_rows(x_TH, tok_C, rows.scores_S[chunk.start : chunk.end, None]).requires_grad_()
    else:
        x_CH = x_TH[tok_C].detach().requires_grad_()
    w_leaves = [w.detach().requires_grad_() for w in _chunk_weights(cfg, weights, chunk)]
    with _autograd_enabled():
        out_CH = _expert_forward(cfg, chunk, rows.src, x_CH, w_leaves)
    return chunk, x_CH, w_leaves, out_CH


def _chunk_vjp(
    cfg: RingStepConfig, rows: HopRows, pending: list[tuple[Chunk, Tensor, list[Tensor], Tensor]],
    x_TH: Tensor, dy_TH: Tensor, dx_TH: Tensor, ds_S: Tensor, dw: WeightGrads,
) -> None:
    """Consume the first recomputed chunk of ``pending``: add its ``dx``, ``d_scores`` and weight-gradient
    contributions. It is popped, so its rows and output are released here as soon as they are used."""
    chunk, x_CH, w_leaves, out_CH = pending.pop(0)
    tok_C = rows.routing.tokens_P[chunk.start : chunk.end]
    dy_CH = dy_TH[tok_C]
    if cfg.scores_before:  # x_CH is u = s x: with g = vjp_F(u)[dy], dx = s g and d_score = <g, x>
        with _autograd_enabled():
            g_CH, *dws = torch.autograd.grad(out_CH, [x_CH, *w_leaves], dy_CH, allow_unused=True)
        del out_CH, dy_CH, x_CH
        if g_CH is None:  # F ignores its rows
            ds_S[chunk.start : chunk.end] = 0
        else:
            ds_S[chunk.start : chunk.end] = _row_dot(g_CH, x_TH[tok_C])
            # autograd's fresh gradient rows (or our own dy gather): scaled in place, rounded once as autograd's
            scatter_add_rows_(dx_TH, tok_C, g_CH.mul_(rows.scores_S[chunk.start : chunk.end, None].to(ACC_DTYPE)))
        dw.add(dws, chunk if cfg.grouped is not None else None)
        return
    ds_S[chunk.start : chunk.end] = _row_dot(dy_CH, out_CH.detach())
    # dy_CH is this chunk's own gather: scaled in place (as dy * s rounds it), not copied.
    dy_CH.mul_(rows.scores_S[chunk.start : chunk.end, None].to(dy_CH.dtype))
    with _autograd_enabled():
        grads = list(torch.autograd.grad(out_CH, [x_CH, *w_leaves], dy_CH, allow_unused=True))
    scatter_add_rows_(dx_TH, tok_C, grads[0])
    dw.add(grads[1:], chunk if cfg.grouped is not None else None)


def segment_backward(
    cfg: RingStepConfig, rows: HopRows, x_TH: Tensor, weights: Sequence[Tensor], dy_TH: Tensor,
    dx_TH: Tensor, ds_S: Tensor, dw: WeightGrads,
) -> None:
    """Per chunk: recompute, vector-Jacobian product, accumulate, release.

    Uses the expert function's fused backward where it has one (``vjp_rows``, else ``vjp``), else autograd
    over a recomputed forward. With scores before ``F`` the fused backward runs on the scaled rows
    (``_scores_before_fused_vjp``).
    """
    grouped = cfg.grouped
    fused = getattr(cfg.expert_fn, "vjp", None)
    no_fused = (grouped is None and fused is None) or (grouped is not None and not grouped.has_fused_backward)
    for chunk in rows.chunks:
        if no_fused:
            _chunk_vjp(cfg, rows, [_recompute_chunk(cfg, rows, chunk, x_TH, weights)], x_TH, dy_TH, dx_TH, ds_S, dw)
            continue
        if cfg.scores_before:
            _scores_before_fused_vjp(cfg, rows, chunk, x_TH, weights, dy_TH, dx_TH, ds_S, dw, fused)
            continue
        c0, c1 = chunk.start, chunk.end
        tok_C = rows.routing.tokens_P[c0:c1]
        if grouped is not None:
            chunk_weights = _chunk_weights(cfg, weights, chunk)
            dx_CH, ds_C, dws = grouped.vjp_rows(
                x_TH, tok_C, chunk.offsets_G, chunk.rows, chunk_weights, dy_TH, rows.scores_S[c0:c1],
                grad_dtype=cfg.sum_dtype(chunk_weights[0]), grad_into=functools.partial(dw.sink, chunk),
            )
        else:
            dx_CH, ds_C, dws = fused(
                x_TH[tok_C], _counts_NL(cfg, chunk, rows.src), _splits_N(cfg, chunk, rows.src), weights,
                dy_TH[tok_C], rows.scores_S[c0:c1],
            )
        ds_S[c0:c1] = ds_C
        scatter_add_rows_(dx_TH, tok_C, dx_CH)
        if dws:  # else the GEMMs added them into ``dw.sink(chunk)``
            dw.add(dws, chunk if grouped is not None else None)


def _scores_before_fused_vjp(
    cfg: RingStepConfig, rows: HopRows, chunk: Chunk, x_TH: Tensor, weights: Sequence[Tensor], dy_TH: Tensor,
    dx_TH: Tensor, ds_S: Tensor, dw: WeightGrads, vjp: ExpertVJP | None,
) -> None:
    """One chunk's backward of ``y[t] += F(s x[t])`` through the fused backward of ``s' F(u)`` at ``s' = 1``
    (``cfg.grouped``'s ``vjp_rows``, else the expert function's ``vjp``).

    The fused entry points differentiate ``score * F(rows)``: on the scaled rows ``u = s x`` with unit scores
    they return ``g = vjp_F(u)[dy]`` and ``F``'s weight gradients at ``u``; then ``dx += s g`` (scaled while
    scattered) and ``d_s = <g, x>`` (a row dot in fp32). The gradient rows of the scaled rows are the
    only extra ``(C, H)`` buffer beside what the scores-after path holds; autograd over a recomputed forward
    held the leaf, the product, every intermediate of ``F`` and their gradients at once.
    """
    c0, c1 = chunk.start, chunk.end
    tok_C = rows.routing.tokens_P[c0:c1]
    score_C1 = rows.scores_S[c0:c1, None]
    unit_C = score_C1.new_ones(c1 - c0, dtype=ACC_DTYPE)
    grouped = cfg.grouped
    if grouped is not None:
        chunk_weights = _chunk_weights(cfg, weights, chunk)
        # tok_S=None: the rows are given (gathered and scaled here); the entry point drops them after use.
        g_CH, _, dws = grouped.vjp_rows(
            _gathered_scaled_rows(x_TH, tok_C, score_C1), None, chunk.offsets_G, chunk.rows, chunk_weights,
            dy_TH[tok_C], unit_C, grad_dtype=cfg.sum_dtype(chunk_weights[0]),
            grad_into=functools.partial(dw.sink, chunk),
        )
    else:
        assert vjp is not None, "hop_compute: no fused backward for scores before the experts"
        g_CH, _, dws = vjp(
            _gathered_scaled_rows(x_TH, tok_C, score_C1), _counts_NL(cfg, chunk, rows.src),
            _splits_N(cfg, chunk, rows.src), weights, dy_TH[tok_C], unit_C,
        )
    ds_S[c0:c1] = _row_dot(g_CH, x_TH[tok_C])
    if grouped is not None:  # our own entry point's fresh rows: scale them in place (rounded once, as autograd's)
        scatter_add_rows_(dx_TH, tok_C, g_CH.mul_(score_C1.to(ACC_DTYPE)))
    else:
        scatter_add_rows_(dx_TH, tok_C, g_CH, score_C1.to(g_CH.dtype))
    if dws:  # else the GEMMs added them into ``dw.sink(chunk)``
        dw.add(dws, chunk if grouped is not None else None)


def _zeros_like(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Zeros of ``t``'s shape (and dtype, or ``dtype``) without allocating them (materialized only where they
    are sent)."""
    return t.new_zeros((), dtype=dtype).expand(t.shape)


def _guarded(method: Callable[..., object], idle: Callable[..., object], step: RingStep, *args: object) -> object:
    """``method(step, *args)``; inside a multi-rank ``RingRun``, an exception marks the run failed instead of
    leaving, and from then on ``idle(step, *args)`` stands in for every guarded computation of the run.

    ``idle`` gives zeros of the partials' shapes, so the program still posts and completes every transfer of
    the schedule and no peer waits on this rank (``transport`` says how the failure is then reported). A
    step driven directly (no run) or a ring of one raises at once.
    """
    run = active_run()
    if run is None or not run.drains:
        return method(step, *args)
    if run.failure is None:
        try:
            return method(step, *args)
        except Exception as e:  # noqa: BLE001 -- any failure: the run raises it once the ring's transfers are done
            hop = f" of hop {args[0]}" if args and isinstance(args[0], int) else ""
            run.fail(e, f"{method.__name__}{hop} of {type(step).__name__}")
    return idle(step, *args)


def _drains(idle: Callable[..., object]) -> Callable[[_Method], _Method]:
    """A step method run through ``_guarded``, ``idle(step, *args)`` standing in once the run failed."""

    def wrap(method: _Method) -> _Method:
        @functools.wraps(method)
        def drained(self, *args):
            return _guarded(method, idle, self, *args)

        return drained  # type: ignore[return-value]

    return wrap


def _no_partials(step: RingStep, *args: object) -> tuple[Tensor, ...]:
    return ()


def _weight_partials(step: RingStep, hop: int, *args: object) -> tuple[Tensor, ...]:
    """Zero weight-gradient partials (expert routing backward): one per circulating weight, in the dtype a
    computed partial of ``hop`` has (what travels must have the same bytes on every rank)."""
    weights = [t for t in args if isinstance(t, Tensor)]
    return tuple(_zeros_like(t, ExpertRoutingStep.partial_dtype(step.cfg, hop, t)) for t in weights)


def _incoming_sums(step: RingStep, hop: int, transfer: RingTransfer, first: int, *args: object) -> tuple[Tensor, ...]:
    """The incoming weight-gradient sums, unchanged (expert routing backward, a hop summing in place)."""
    return transfer.wait()[first:]


def _token_partials(step: RingStep, hop: int, *args: object) -> tuple[Tensor, ...]:
    """Zero partials of the visiting tokens: ``y`` (forward), ``dx`` and ``d_scores`` (backward)."""
    x_TH, _, scores_TK, *_ = [t for t in args if isinstance(t, Tensor)]
    y_TH = _zeros_like(x_TH, step.cfg.sum_dtype(x_TH))
    return (y_TH, _zeros_like(scores_TK)) if step.backward else (y_TH,)


def _no_activations(step: RingStep, *args: object) -> HopActivations:
    return HopActivations()


def _trailing(step: RingStep, *trailing: Tensor) -> tuple[Tensor, ...]:
    return trailing


def _setup(step: RingStep, plan: Callable[..., None], *args: object) -> None:
    """The step's planning after the agreement, guarded like a hop (a failure there drains too)."""
    _guarded(plan, _no_partials, step, *args)


def local_counts(cfg: RingStepConfig, x_TH: Tensor, topk_ids_TK: Tensor) -> StepCounts:
    """The counts of a ring of one, without an agreement (a step driven directly); raises on bad ids."""
    assert cfg.ring.size == 1, "ring_moe: a step of a multi-rank ring plans from the agreed counts"
    ids_TK, bad = clamped_ids(cfg.num_experts, topk_ids_TK)
    # NOTE: device-to-host sync, once per step.
    local_bad, *counts = torch.cat([bad, PairRouting.counts(ids_TK, cfg.num_experts)]).tolist()
    if local_bad:
        raise_bad_ids(cfg.ring.rank, cfg.num_experts, [cfg.ring.rank])
    return StepCounts(tokens_N=[x_TH.shape[0]], counts_NE=[counts])


class ExpertRoutingStep:
    """Expert routing: ``x`` stays, weight partitions circulate (and their gradients one hop behind).

    ``counts``: the agreed counts (``runtime.agreement``; None: a ring of one counts its own). ``packed``:
    the weights already in the expert function's packed layout.
    """

    def __init__(
        self, cfg: RingStepConfig, x_TH: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor,
        weights: Sequence[Tensor], grad_y_TH: Tensor | None = None, *, counts: StepCounts | None = None,
        packed: list[Tensor] | None = None,
    ) -> None:
        self.cfg, self.x_TH, self.given_weights = cfg, x_TH, list(weights)
        self.weights = pack_weights(cfg.grouped, weights) if packed is None else packed
        self.grad_y_TH = grad_y_TH
        self.backward = grad_y_TH is not None
        self.topk_shape = topk_scores_TK.shape
        counts = counts or local_counts(cfg, x_TH, topk_ids_TK)
        _setup(self, ExpertRoutingStep._plan, topk_ids_TK, topk_scores_TK, counts)

    def _plan(self, topk_ids_TK: Tensor, topk_scores_TK: Tensor, counts: StepCounts) -> None:
        cfg, e_l, x_TH = self.cfg, self.cfg.experts_per_rank, self.x_TH
        own = counts.counts_NE[cfg.ring.rank]
        assert own is not None, "ring_moe: the agreement gave no counts of this rank"
        self.routing = routing = PairRouting.build(topk_ids_TK, own, e_l)
        self.chunks = plan_chunks([
            split_experts(routing.rows_per_expert(owner), routing.starts_host[owner * e_l], cfg.max_hop_rows)
            for owner in range(cfg.ring.size)
        ], e_l, x_TH.device)
        self.scores_S = topk_scores_TK.reshape(-1)[routing.order_P]
        # y / dx sum a token's pairs over the hops they meet on: in the sum dtype (module docstring).
        if self.grad_y_TH is None:
            self.y_TH = torch.zeros_like(x_TH, dtype=cfg.sum_dtype(x_TH))
        else:
            self.dx_TH = torch.zeros_like(x_TH, dtype=cfg.sum_dtype(x_TH))
            # Every pair meets its expert on exactly one hop, so every entry is written.
            self.ds_S = torch.empty(self.scores_S.shape, dtype=ACC_DTYPE, device=x_TH.device)

    def initial_circulating(self) -> list[Tensor]:
        return self.weights

    def receive_buffers(self, hop: int, num_circulating: int, payload: Sequence[Tensor]) -> list[Tensor]:
        # Every partition (and its gradient) has the shapes of the local one: agreed at every call.
        return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in payload]

    def _rows(self, hop: int) -> HopRows:
        owner = (self.cfg.ring.rank - hop) % self.cfg.ring.size
        return HopRows(routing=self.routing, chunks=self.chunks[owner], src=self.cfg.ring.rank,
                       scores_S=self.scores_S)

    @_drains(_no_partials)
    def forward_hop(self, hop: int, *weights: Tensor) -> tuple[Tensor, ...]:
        segment_forward(self.cfg, self._rows(hop), self.x_TH, weights, self.y_TH)
        return ()

    @staticmethod
    def partial_dtype(cfg: RingStepConfig, hop: int, weight: Tensor) -> torch.dtype | None:
        """Dtype of a weight-gradient partial of ``hop`` (None: as computed).

        Hop 0's partial starts the travelling sum, so it has the sum's dtype on every rank; a later hop's is
        added into the incoming fp32 sum as it is (``instructions.accumulate``), never copied to fp32.
        """
        return cfg.sum_dtype(weight) if hop == 0 else None

    def _weight_grads(self, hop: int, dw: WeightGrads, weights: Sequence[Tensor]) -> tuple[Tensor, ...]:
        return dw.result([self.partial_dtype(self.cfg, hop, w) for w in weights])

    @_drains(_weight_partials)
    def backward_hop(self, hop: int, *weights: Tensor) -> tuple[Tensor, ...]:
        dw = WeightGrads(weights, self.cfg.acc_dtype)
        assert self.grad_y_TH is not None
        segment_backward(self.cfg, self._rows(hop), self.x_TH, weights, self.grad_y_TH, self.dx_TH, self.ds_S, dw)
        return self._weight_grads(hop, dw, weights)

    @_drains(_incoming_sums)
    def backward_hop_into(self, hop: int, transfer: RingTransfer, first: int, *weights: Tensor) -> tuple[Tensor, ...]:
        """``backward_hop`` whose weight gradients add into the sums travelling in ``transfer`` (its received
        tensors from position ``first``): waited for right before the hop's first weight-gradient GEMM, so
        the hop keeps no partial of its own; returns those sums, now including this hop."""
        dw = WeightGrads(weights, self.cfg.acc_dtype, into=lambda: transfer.wait()[first:])
        assert self.grad_y_TH is not None
        segment_backward(self.cfg, self._rows(hop), self.x_TH, weights, self.grad_y_TH, self.dx_TH, self.ds_S, dw)
        return dw.result()

    @_drains(_no_activations)
    def recompute_hop(self, hop: int, *weights: Tensor) -> HopActivations:
        rows = self._rows(hop)
        return HopActivations(chunks=[_recompute_chunk(self.cfg, rows, c, self.x_TH, weights) for c in rows.chunks])

    @_drains(_weight_partials)
    def vjp_hop(self, hop: int, acts: HopActivations, *weights: Tensor) -> tuple[Tensor, ...]:
        dw = WeightGrads(weights, self.cfg.acc_dtype)
        assert self.grad_y_TH is not None
        rows = self._rows(hop)
        while acts.chunks:
            _chunk_vjp(self.cfg, rows, acts.chunks, self.x_TH, self.grad_y_TH, self.dx_TH, self.ds_S, dw)
        acts.chunks.clear()
        return self._weight_grads(hop, dw, weights)

    @_drains(_trailing)
    def finish(self, *trailing: Tensor) -> tuple[Tensor, ...]:
        dtype = self.x_TH.dtype
        if self.grad_y_TH is None:
            return (self.y_TH.to(dtype),)
        ds_P = torch.empty_like(self.ds_S).index_copy_(0, self.routing.order_P, self.ds_S)
        return (self.dx_TH.to(dtype), ds_P.to(self.scores_S.dtype).view(self.topk_shape),
                *unpack_grads(self.cfg.grouped, trailing, self.weights, self.given_weights))


class TokenRoutingStep:
    """Token routing: experts stay, token partitions circulate (and their accumulators one hop behind).

    ``counts``: the agreed counts, every rank's (``runtime.agreement``; None: a ring of one counts its own).
    """

    def __init__(
        self, cfg: RingStepConfig, x_TH: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor,
        weights: Sequence[Tensor], grad_y_TH: Tensor | None = None, *, counts: StepCounts | None = None,
        packed: list[Tensor] | None = None,
    ) -> None:
        self.cfg, self.given_weights = cfg, list(weights)
        self.weights = pack_weights(cfg.grouped, weights) if packed is None else packed
        self.circulating = [x_TH, topk_ids_TK, topk_scores_TK]
        if grad_y_TH is not None:
            self.circulating.append(grad_y_TH)
            self.dw = WeightGrads(self.weights, cfg.acc_dtype)
        self.backward = grad_y_TH is not None
        counts = counts or local_counts(cfg, x_TH, topk_ids_TK)
        # Per source rank: its token count, then its pairs per global expert (every rank's: token routing).
        self.rows_N = counts.tokens_N
        self.counts_host_NE: list[list[int]] = [c for c in counts.counts_NE if c is not None]
        assert len(self.counts_host_NE) == cfg.ring.size, "ring_moe: token routing needs every rank's counts"
        _setup(self, TokenRoutingStep._plan)

    def _plan(self) -> None:
        e_l, rank = self.cfg.experts_per_rank, self.cfg.ring.rank
        own = slice(rank * e_l, (rank + 1) * e_l)
        self.chunks = plan_chunks([
            split_experts(self.counts_host_NE[src][own], sum(self.counts_host_NE[src][: own.start]),
                          self.cfg.max_hop_rows)
            for src in map(self._source, range(self.cfg.ring.size))
        ], e_l, self.circulating[0].device)

    def initial_circulating(self) -> list[Tensor]:
        return self.circulating

    def _source(self, hop: int) -> int:
        return (self.cfg.ring.rank - hop) % self.cfg.ring.size

    def _rows_shaped(self, t: Tensor, rows: int, dtype: torch.dtype | None = None) -> Tensor:
        return t.new_empty((rows, *t.shape[1:]), dtype=dtype or t.dtype)

    def receive_buffers(self, hop: int, num_circulating: int, payload: Sequence[Tensor]) -> list[Tensor]:
        # The transfer sent at ``hop`` brings the tokens of hop ``hop + 1`` and the accumulators of ``hop``.
        rows_next = self.rows_N[self._source(hop + 1)]
        rows_acc = self.rows_N[self._source(hop)]
        return [self._rows_shaped(t, rows_next) for t in payload[:num_circulating]] + [
            self._rows_shaped(t, rows_acc) for t in payload[num_circulating:]
        ]

    def _rows(self, hop: int, ids_TK: Tensor, scores_TK: Tensor) -> HopRows:
        src = self._source(hop)
        routing = PairRouting.build(ids_TK, self.counts_host_NE[src], self.cfg.experts_per_rank)
        return HopRows(routing=routing, chunks=self.chunks[hop], src=src,
                       scores_S=scores_TK.reshape(-1)[routing.order_P])

    def _own_range(self, rows: HopRows) -> tuple[int, int]:
        return rows.routing.owner_range(self.cfg.ring.rank)

    def _scores_grad(self, rows: HopRows, ds_S: Tensor, scores_TK: Tensor) -> Tensor:
        """``d_scores`` of the visiting partition: this rank's pairs from ``ds_S``, zeros elsewhere."""
        a, b = self._own_range(rows)
        ds_P = torch.zeros_like(ds_S).index_copy_(0, rows.routing.order_P[a:b], ds_S[a:b])
        return ds_P.to(scores_TK.dtype).view(scores_TK.shape)

    def _token_sum(self, x_TH: Tensor) -> Tensor:
        """A zero ``y``/``dx`` partial of the visiting tokens, in the dtype their sum travels in."""
        return torch.zeros_like(x_TH, dtype=self.cfg.sum_dtype(x_TH))

    @_drains(_token_partials)
    def forward_hop(self, hop: int, x_TH: Tensor, ids_TK: Tensor, scores_TK: Tensor) -> tuple[Tensor, ...]:
        y_TH = self._token_sum(x_TH)
        segment_forward(self.cfg, self._rows(hop, ids_TK, scores_TK), x_TH, self.weights, y_TH)
        return (y_TH,)

    @_drains(_token_partials)
    def backward_hop(
        self, hop: int, x_TH: Tensor, ids_TK: Tensor, scores_TK: Tensor, dy_TH: Tensor
    ) -> tuple[Tensor, ...]:
        rows = self._rows(hop, ids_TK, scores_TK)
        dx_TH = self._token_sum(x_TH)
        ds_S = torch.empty(scores_TK.numel(), dtype=ACC_DTYPE, device=x_TH.device)
        segment_backward(self.cfg, rows, x_TH, self.weights, dy_TH, dx_TH, ds_S, self.dw)
        return dx_TH, self._scores_grad(rows, ds_S, scores_TK)

    @_drains(_no_activations)
    def recompute_hop(self, hop: int, x_TH: Tensor, ids_TK: Tensor, scores_TK: Tensor) -> HopActivations:
        rows = self._rows(hop, ids_TK, scores_TK)
        return HopActivations(chunks=[_recompute_chunk(self.cfg, rows, c, x_TH, self.weights) for c in rows.chunks])

    @_drains(_token_partials)
    def vjp_hop(
        self, hop: int, acts: HopActivations, x_TH: Tensor, ids_TK: Tensor, scores_TK: Tensor, dy_TH: Tensor
    ) -> tuple[Tensor, ...]:
        rows = self._rows(hop, ids_TK, scores_TK)
        dx_TH = self._token_sum(x_TH)
        ds_S = torch.empty(scores_TK.numel(), dtype=ACC_DTYPE, device=x_TH.device)
        while acts.chunks:
            _chunk_vjp(self.cfg, rows, acts.chunks, x_TH, dy_TH, dx_TH, ds_S, self.dw)
        acts.chunks.clear()
        return dx_TH, self._scores_grad(rows, ds_S, scores_TK)

    @_drains(_trailing)
    def finish(self, *trailing: Tensor) -> tuple[Tensor, ...]:
        # The returned y (forward) or dx (backward) in the tokens' dtype; d_scores has it already.
        token_sum, *rest = trailing
        token_sum = token_sum.to(self.circulating[0].dtype)
        if not self.backward:
            return (token_sum, *rest)
        return (token_sum, *rest, *unpack_grads(self.cfg.grouped, self.dw.result(), self.weights, self.given_weights))


RingStep = ExpertRoutingStep | TokenRoutingStep


def clamped_ids(num_experts: int, topk_ids_TK: Tensor) -> tuple[Tensor, Tensor]:
    """Ids safe to count with, and a ``(1,)`` int64 flag: does this rank hold ids outside ``[0, E)``?"""
    bad = ((topk_ids_TK < 0) | (topk_ids_TK >= num_experts)).any().to(torch.int64).reshape(1)
    return topk_ids_TK.clamp(0, num_experts - 1), bad

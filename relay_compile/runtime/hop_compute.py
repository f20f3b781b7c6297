"""Ring steps: one call of the ring bound to its hops, whose pairs and weights meet where, and its transfers.

A ``RingStep`` binds one call of the ring (one forward or one backward of one MoE block) to the ring
programs: the programs say *when* (hop order, transfers), the step says *what* (which pairs, which rows).

- ``ExpertRoutingStep``: tokens stay; at hop ``h`` rank ``r`` holds the weights of owner ``(r - h) mod N`` and
  computes its own pairs for that owner. A grouped ring (``owners_per_hop = g > 1``, ``programs.build``)
  holds ``g`` owners per hop, the first stack gathered at hop 0: stack ``j`` is owners ``r - g j - g + 1 .. r - g j``,
  one weight tensor per packed weight with ``g E_l`` experts, computed as one segment where their sorted rows
  are contiguous. Backward sums the owner's weight gradients one hop behind the
  weights: hop 0 starts the sum, every later hop's GEMMs add into the sum arriving from the previous rank
  (``backward_hop_into``; the program pass ``sum_in_place``), so no hop holds a partial beside it. A grouped
  backward's first stack starts a gradient stack (in the sums' dtype), which then trails the weight stacks.
- ``TokenRoutingStep``: experts stay; at hop ``h`` rank ``r`` holds the tokens of source ``(r - h) mod N`` and
  computes their pairs for its own experts. The output (backward: ``dx``, ``d_scores``) accumulator travels
  one hop behind the tokens, and every hop but the first adds into it as it arrives (``forward_hop_into``,
  ``backward_hop_into``: the program pass ``sum_in_place``); weight gradients accumulate locally. A grouped ring holds ``g`` sources' tokens per
  hop, stacked row after row and computed as one visiting partition; their sums trail the stacks and each slot
  returns to its source.

What a hop computes on its pairs, chunk by chunk (forward, recomputed backward, scores before or after F,
the sums across hops), is ``segment_compute``; this module binds it to the ring's hops and transfers.

A step plans from counts every rank agreed on (``runtime.agreement``; a step driven directly on a ring of
one counts its own). Inside a multi-rank ``transport.RingRun`` the step never raises out of a hop: the
first exception marks the run failed, and its setup, hops and ``finish`` then return zeros of the
partials' shapes without computing, so the program completes every transfer (``_guarded``).

Legend: T tokens, H hidden, K top-k, P = T*K pairs, C rows of a chunk, N ranks, E experts, E_l = E / N.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from relay_compile.grouped_gemm import grouped_mm_supported
from relay_compile.routing import PairOrder, PairRouting, plan_chunks, split_experts, split_owners
from relay_compile.runtime.agreement import StepCounts, raise_bad_ids
from relay_compile.runtime.chunk_graphs import PaddedChunks
from relay_compile.runtime.equal_groups import EqualGroups
from relay_compile.runtime.row_sum import RowSum
from relay_compile.runtime.segment_compute import (
    ACC_DTYPE,
    HopActivations,
    HopRows,
    RingStepConfig,
    chunk_vjp,
    recompute_chunk,
    segment_backward,
    segment_forward,
)
from relay_compile.runtime.transport import RingTransfer, RingTransportError, active_run, receive_buffers
from relay_compile.runtime.weight_grads import WeightGrads, grads_like, pack_weights, unpack_grads

_Method = TypeVar("_Method", bound=Callable[..., Any])

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
        except RingTransportError:  # the link itself failed (a hop waiting for the sums it adds into): as ring_wait
            raise
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
    """Zero weight-gradient partials (expert routing backward): one per packed weight's gradient
    (``grads_like``), in the dtype a computed partial of ``hop`` has (what travels must have the same bytes on
    every rank)."""
    assert isinstance(step, ExpertRoutingStep)
    return tuple(_zeros_like(g, ExpertRoutingStep.partial_dtype(step.cfg, hop, g)) for g in step.grads_like)


def _stack_partials(step: RingStep, group: int, *args: object) -> tuple[Tensor, ...]:
    """Zero weight-gradient partials of an owner stack (a grouped backward hop), in the dtype a computed one of
    ``group`` has (group 0's start the travelling sums)."""
    assert isinstance(step, ExpertRoutingStep)
    return tuple(_zeros_like(g, ExpertRoutingStep.partial_dtype(step.cfg, group, g)) for g in step.stack_grads_like)


def _arrived_sums(transfer: RingTransfer, first: int) -> tuple[Tensor, ...]:
    """The sums arriving with ``transfer`` from its received position ``first`` on, once their batch arrived."""
    assert transfer.trailing_from in (0, first), "hop_compute: the sums start where the transfer split its batches"
    return transfer.wait_trailing() if transfer.trailing_from else transfer.wait()[first:]


def _incoming_sums(step: RingStep, hop: int, transfer: RingTransfer, first: int, *args: object) -> tuple[Tensor, ...]:
    """The incoming trailing sums, unchanged (a hop summing in place: expert routing's weight gradients, token
    routing's ``y``, ``dx`` and ``d_scores``)."""
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


def _grouped_receive_buffers(
    cfg: RingStepConfig, hop: int, num_circulating: int, specs: Sequence[tuple[Sequence[int], torch.dtype]],
    device: torch.device,
) -> list[Tensor]:
    """A transfer's receive buffers: the circulating tensors in one buffer, the trailing accumulators in another
    (``transport``: each group travels as one span and keeps its own lifetime). The ring's last transfer returns
    the accumulators to their owners: they become the op's outputs, which must not alias (separate tensors)."""
    flat = hop < cfg.ring.size
    return (receive_buffers(specs[:num_circulating], device, flat=flat)
            + receive_buffers(specs[num_circulating:], device, flat=flat))


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
    the weights already in the expert function's packed layout. ``projections``: forward, True saves every
    pair's first projection (``finish`` returns them after ``y``); backward, the forward's saved ones, read
    instead of recomputing them (``saved_projections.can_save`` says where either applies).
    """

    def __init__(
        self, cfg: RingStepConfig, x_TH: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor,
        weights: Sequence[Tensor], grad_y_TH: Tensor | None = None, *, counts: StepCounts | None = None,
        packed: list[Tensor] | None = None, owners_per_hop: int = 1, projections: Tensor | bool = False,
        order: PairOrder | None = None, sum_TH: RowSum | None = None,
    ) -> None:
        assert projections is False or (cfg.grouped is not None and not cfg.scores_before), (
            "ring_moe: only grouped experts with scores after them save projections")
        self.cfg, self.x_TH, self.given_weights = cfg, x_TH, list(weights)
        self.weights = pack_weights(cfg.grouped, weights) if packed is None else packed
        # What a visiting partition's gradients look like (every partition has the local one's shapes).
        self.grads_like = grads_like(cfg.grouped, self.weights, weights)
        self.grad_y_TH = grad_y_TH
        self.backward = grad_y_TH is not None
        self.topk_shape = topk_scores_TK.shape
        assert owners_per_hop == 1 or cfg.grouped is not None, (
            "ring_moe: only a grouped expert function holds several owners per hop")
        self.owners_per_hop = owners_per_hop
        self.stack: list[Tensor] = []  # the grouped ring's first owner stack (``receive_buffers``)
        # What a stack's gradients look like: ``grads_like`` with ``g E_l`` experts (shapes and dtypes only).
        self.stack_grads_like = [g.new_zeros(()).expand(owners_per_hop * g.shape[0], *g.shape[1:])
                                 for g in self.grads_like]
        counts = counts or local_counts(cfg, x_TH, topk_ids_TK)
        _setup(self, ExpertRoutingStep._plan, topk_ids_TK, topk_scores_TK, counts, projections, order, sum_TH)

    def _group_owners(self, group: int) -> list[int]:
        """The owners of stack ``group`` in slot order (ascending, as their experts sort, unless they wrap)."""
        g, n, r = self.owners_per_hop, self.cfg.ring.size, self.cfg.ring.rank
        return [(r - g * group - g + 1 + s) % n for s in range(g)]

    def _plan(self, topk_ids_TK: Tensor, topk_scores_TK: Tensor, counts: StepCounts, projections: Tensor | bool,
              order: PairOrder | None, sum_TH: RowSum | None) -> None:
        """``order``, ``sum_TH``: the pairs' sort and the zeroed sum, queued before the agreement's read
        (``runtime.queued_ahead``); else made here."""
        cfg, e_l, x_TH, g = self.cfg, self.cfg.experts_per_rank, self.x_TH, self.owners_per_hop
        own = counts.counts_NE[cfg.ring.rank]
        assert own is not None, "ring_moe: the agreement gave no counts of this rank"
        # y / dx sum a token's pairs over the hops they meet on: in the sum dtype (module docstring). Zeroed first
        # where not queued ahead: the fill (the pairs' sort next) runs while the host plans the chunks below.
        if sum_TH is None:
            sum_TH = RowSum(x_TH, cfg.sum_dtype(x_TH))
        if self.grad_y_TH is None:
            self.y = sum_TH
        else:
            self.dx = sum_TH
        self.routing = routing = PairRouting.build(topk_ids_TK, own, e_l, order)
        # One owner per hop, or g: owner stacks (``programs.build``: the grouped rings).
        bounds = [
            split_experts(routing.rows_per_expert(owner), routing.starts_host[owner * e_l], cfg.max_hop_rows)
            for owner in range(cfg.ring.size)
        ] if g == 1 else []
        groups = [split_owners(routing, self._group_owners(j), cfg.max_hop_rows)
                  for j in range(cfg.ring.size // g)] if g > 1 else []
        chunks = plan_chunks(bounds + groups, [e_l] * len(bounds) + [g * e_l] * len(groups), x_TH.device)
        self.chunks, self.group_chunks = chunks[: len(bounds)], chunks[len(bounds):]
        self.scores_S = (torch.index_select(topk_scores_TK.reshape(-1), 0, routing.order_P) if order is None
                         else order.scores_S)
        self.projections_PU: Tensor | None = None
        if projections is True:  # in the packed first matrix's columns and dtype (``projection_dtype``)
            first = self.weights[0]
            self.projections_PU = first.new_empty((routing.order_P.shape[0], first.shape[1]))
        elif isinstance(projections, Tensor):
            self.projections_PU = projections
        # Padded and equal-group chunks are planned for one owner per hop (stacks run their chunks as they are);
        # chunk programs not beside saved projections (their static buffers take the rows' own projections),
        # equal groups beside them too (a padded chunk gathers its rows' saved projections, ``segment_backward``).
        saved = self.projections_PU is not None
        graphs = g == 1 and not saved and cfg.pads_chunks and grouped_mm_supported(x_TH, *self.weights[:2])
        self.padded = PaddedChunks.plan(self.chunks, routing.tokens_P, self.scores_S) if graphs else None
        self.equal = (EqualGroups.plan(self.chunks, routing.tokens_P, self.scores_S)
                      if g == 1 and self.backward and self.padded is None and cfg.pads_equal_groups else None)
        if self.grad_y_TH is not None:
            # Every pair meets its expert on exactly one hop, so every entry is written; one entry past the pairs
            # takes what the padding rows of equal groups write (``finish``).
            self.ds_S1 = torch.empty(self.scores_S.shape[0] + 1, dtype=ACC_DTYPE, device=x_TH.device)
            self.ds_S = self.ds_S1[:-1]

    def initial_circulating(self) -> list[Tensor]:
        return self.weights

    @property
    def sums_travel_first(self) -> bool:
        """The backward's hops add into the sums they receive (``sum_in_place``): its transfers send the sums
        ahead of the weights, as a batch of their own (``ring_start``, ``RingTransfer.wait_trailing``)."""
        return self.backward

    def receive_buffers(
        self, hop: int, num_circulating: int, payload: Sequence[Tensor], slot: int | None = None
    ) -> list[Tensor]:
        """Where a transfer sent at ``hop`` arrives; ``slot``: that slot of the first owner stack (a grouped ring's
        gather).
        Every partition (and its gradient, and a stack) has the shapes of the local one's: agreed at every call."""
        if slot is not None:
            e_l = self.cfg.experts_per_rank
            if not self.stack:
                self.stack = [w.new_empty((self.owners_per_hop * e_l, *w.shape[1:])) for w in self.weights]
            return [t[slot * e_l : (slot + 1) * e_l] for t in self.stack]
        return _grouped_receive_buffers(self.cfg, hop, num_circulating, [(t.shape, t.dtype) for t in payload],
                                        payload[0].device)

    def stack_owners(self) -> tuple[Tensor, ...]:
        """The first owner stack (owners ``r - g + 1 .. r``): the earlier slots arrived, this rank's own weights
        go into the last."""
        e_l, g = self.cfg.experts_per_rank, self.owners_per_hop
        for t, w in zip(self.stack, self.weights, strict=True):
            t[(g - 1) * e_l :].copy_(w)
        stack, self.stack = tuple(self.stack), []
        return stack

    def unstack(self, slot: int, *stacked: Tensor) -> tuple[Tensor, ...]:
        """Slot ``slot`` of owner stacks: one owner's experts of each stacked tensor (views)."""
        e_l = self.cfg.experts_per_rank
        return tuple(t[slot * e_l : (slot + 1) * e_l] for t in stacked)

    def _group_rows(self, group: int) -> HopRows:
        return HopRows(routing=self.routing, chunks=self.group_chunks[group], src=self.cfg.ring.rank,
                       scores_S=self.scores_S, projections_PU=self.projections_PU)

    def _rows(self, hop: int) -> HopRows:
        owner = (self.cfg.ring.rank - hop) % self.cfg.ring.size
        return HopRows(routing=self.routing, chunks=self.chunks[owner], src=self.cfg.ring.rank,
                       scores_S=self.scores_S, padded=self.padded, equal=self.equal,
                       projections_PU=self.projections_PU)

    @_drains(_no_partials)
    def forward_hop(self, hop: int, *weights: Tensor) -> tuple[Tensor, ...]:
        segment_forward(self.cfg, self._rows(hop), self.x_TH, weights, self.y)
        return ()

    @_drains(_no_partials)
    def forward_group(self, group: int, *stacked: Tensor) -> tuple[Tensor, ...]:
        """The pairs of this rank that meet owner stack ``group`` (``stacked``: the owners' weights, stacked)."""
        segment_forward(self.cfg, self._group_rows(group), self.x_TH, stacked, self.y)
        return ()

    @staticmethod
    def partial_dtype(cfg: RingStepConfig, hop: int, weight: Tensor) -> torch.dtype | None:
        """Dtype of a weight-gradient partial of ``hop`` (None: as computed).

        Hop 0's partial starts the travelling sum, so it has the sum's dtype on every rank; a later hop's is
        added into the incoming fp32 sum as it is (``instructions.accumulate``), never copied to fp32.
        """
        return cfg.sum_dtype(weight) if hop == 0 else None

    def _weight_grads(self, hop: int, dw: WeightGrads) -> tuple[Tensor, ...]:
        return dw.result([self.partial_dtype(self.cfg, hop, g) for g in self.grads_like])

    @_drains(_weight_partials)
    def backward_hop(self, hop: int, *weights: Tensor) -> tuple[Tensor, ...]:
        dw = WeightGrads(self.grads_like, self.cfg.acc_dtype)
        assert self.grad_y_TH is not None
        segment_backward(self.cfg, self._rows(hop), self.x_TH, weights, self.grad_y_TH, self.dx, self.ds_S, dw)
        return self._weight_grads(hop, dw)

    @_drains(_incoming_sums)
    def backward_hop_into(self, hop: int, transfer: RingTransfer, first: int, *weights: Tensor) -> tuple[Tensor, ...]:
        """``backward_hop`` whose weight gradients add into the sums travelling in ``transfer`` (its received
        tensors from position ``first``): waited for right before the hop's first weight-gradient GEMM, so
        the hop keeps no partial of its own; returns those sums, now including this hop."""
        dw = WeightGrads(self.grads_like, self.cfg.acc_dtype, into=lambda: _arrived_sums(transfer, first))
        assert self.grad_y_TH is not None
        segment_backward(self.cfg, self._rows(hop), self.x_TH, weights, self.grad_y_TH, self.dx, self.ds_S, dw)
        return dw.result()

    @_drains(_stack_partials)
    def backward_group(self, group: int, *stacked: Tensor) -> tuple[Tensor, ...]:
        """The pairs of this rank that meet owner stack ``group``; the stack's gradient partials (group 0's
        start the travelling sums: in their dtype, ``partial_dtype``)."""
        dw = WeightGrads(self.stack_grads_like, self.cfg.acc_dtype)
        assert self.grad_y_TH is not None
        segment_backward(self.cfg, self._group_rows(group), self.x_TH, stacked, self.grad_y_TH, self.dx, self.ds_S,
                         dw)
        return dw.result([self.partial_dtype(self.cfg, group, g) for g in self.stack_grads_like])

    @_drains(_incoming_sums)
    def backward_group_into(self, group: int, transfer: RingTransfer, first: int, *stacked: Tensor
                            ) -> tuple[Tensor, ...]:
        """``backward_group`` adding into the stack's gradient sums arriving with ``transfer`` (as
        ``backward_hop_into``)."""
        dw = WeightGrads(self.stack_grads_like, self.cfg.acc_dtype, into=lambda: _arrived_sums(transfer, first))
        assert self.grad_y_TH is not None
        segment_backward(self.cfg, self._group_rows(group), self.x_TH, stacked, self.grad_y_TH, self.dx, self.ds_S,
                         dw)
        return dw.result()

    @_drains(_no_activations)
    def recompute_hop(self, hop: int, *weights: Tensor) -> HopActivations:
        rows = self._rows(hop)
        return HopActivations(chunks=[recompute_chunk(self.cfg, rows, c, self.x_TH, weights) for c in rows.chunks])

    @_drains(_weight_partials)
    def vjp_hop(self, hop: int, acts: HopActivations, *weights: Tensor) -> tuple[Tensor, ...]:
        dw = WeightGrads(self.grads_like, self.cfg.acc_dtype)
        assert self.grad_y_TH is not None
        rows = self._rows(hop)
        while acts.chunks:
            chunk_vjp(self.cfg, rows, acts.chunks, self.x_TH, self.grad_y_TH, self.dx, self.ds_S, dw)
        acts.chunks.clear()
        return self._weight_grads(hop, dw)

    @_drains(_trailing)
    def finish(self, *trailing: Tensor) -> tuple[Tensor, ...]:
        dtype = self.x_TH.dtype
        if self.grad_y_TH is None:
            y_TH = self.y.finish(dtype)
            return (y_TH,) if self.projections_PU is None else (y_TH, self.projections_PU)
        if self.equal is not None:
            self.equal.scores_grad_into(self.ds_S1)
        ds_P = torch.empty_like(self.ds_S).index_copy_(0, self.routing.order_P, self.ds_S)
        if self.owners_per_hop > 1:  # the g sums returned to this owner, one per residue class of ranks
            n = len(self.grads_like)
            trailing = tuple(functools.reduce(torch.add, trailing[i::n]) for i in range(n))
        return (self.dx.finish(dtype), ds_P.to(self.scores_S.dtype).view(self.topk_shape),
                *unpack_grads(self.cfg.grouped, trailing, self.grads_like, self.given_weights))


class TokenRoutingStep:
    """Token routing: experts stay, token partitions circulate (and their accumulators one hop behind).

    ``counts``: the agreed counts, every rank's (``runtime.agreement``; None: a ring of one counts its own).
    ``owners_per_hop``: ``g`` sources' tokens per hop (``programs.build``: the grouped rings): stack ``j`` holds
    sources ``r - g j - g + 1 .. r - g j``, their rows one after the other in that slot order, and is computed as
    one visiting partition (its pairs per expert are the sum of its sources'); its sums trail it and each slot
    returns to its source, which adds the ``g`` it receives.
    """

    def __init__(
        self, cfg: RingStepConfig, x_TH: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor,
        weights: Sequence[Tensor], grad_y_TH: Tensor | None = None, *, counts: StepCounts | None = None,
        packed: list[Tensor] | None = None, owners_per_hop: int = 1,
    ) -> None:
        self.cfg, self.given_weights = cfg, list(weights)
        self.weights = pack_weights(cfg.grouped, weights) if packed is None else packed
        self.grads_like = grads_like(cfg.grouped, self.weights, weights)
        self.circulating = [x_TH, topk_ids_TK, topk_scores_TK]
        if grad_y_TH is not None:
            self.circulating.append(grad_y_TH)
            self.dw = WeightGrads(self.grads_like, cfg.acc_dtype)
        self.backward = grad_y_TH is not None
        self.owners_per_hop = owners_per_hop
        self.stack: list[Tensor] = []  # the grouped ring's first stack (``receive_buffers``)
        counts = counts or local_counts(cfg, x_TH, topk_ids_TK)
        # Per source rank: its token count, then its pairs per global expert (every rank's: token routing).
        self.rows_N = counts.tokens_N
        self.counts_host_NE: list[list[int]] = [c for c in counts.counts_NE if c is not None]
        assert len(self.counts_host_NE) == cfg.ring.size, "ring_moe: token routing needs every rank's counts"
        _setup(self, TokenRoutingStep._plan)

    def _plan(self) -> None:
        e_l, rank, n, g = self.cfg.experts_per_rank, self.cfg.ring.rank, self.cfg.ring.size, self.owners_per_hop
        own = slice(rank * e_l, (rank + 1) * e_l)
        # What each hop's visiting partition holds: one source's pairs per expert, or a stack's (their sums).
        self.hop_counts_E = [
            self.counts_host_NE[(rank - hop) % n] if g == 1
            else [sum(c) for c in zip(*(self.counts_host_NE[src] for src in self._sources(hop)), strict=True)]
            for hop in range(n // g)
        ]
        self.chunks = plan_chunks([split_experts(c[own], sum(c[: own.start]), self.cfg.max_hop_rows)
                                   for c in self.hop_counts_E], e_l, self.circulating[0].device)

    def initial_circulating(self) -> list[Tensor]:
        return self.circulating

    def _sources(self, hop: int) -> list[int]:
        """The sources whose tokens visit at ``hop`` (a grouped ring: stack ``hop``), in slot order."""
        g, n, r = self.owners_per_hop, self.cfg.ring.size, self.cfg.ring.rank
        return [(r - g * hop - g + 1 + s) % n for s in range(g)]

    def _stack_rows(self, hop: int) -> int:
        """Rows of the partition visiting at ``hop``; past the last hop, this rank's own: what the sums returned
        to it hold (the last transfer of a plain ring, each slot's return of a grouped one)."""
        if hop >= self.cfg.ring.size // self.owners_per_hop:
            return self.rows_N[self.cfg.ring.rank]
        return sum(self.rows_N[src] for src in self._sources(hop))

    def _slot_rows(self, hop: int, slot: int) -> tuple[int, int]:
        """Row range ``[a, b)`` of slot ``slot`` in the stack visiting at ``hop``."""
        sources = self._sources(hop)
        a = sum(self.rows_N[src] for src in sources[:slot])
        return a, a + self.rows_N[sources[slot]]

    # Its hops add into the sums they receive (``sum_in_place``; the first hop starts them): its transfers send the
    # sums ahead of the next tokens, as a batch of their own.
    sums_travel_first = True

    def receive_buffers(
        self, hop: int, num_circulating: int, payload: Sequence[Tensor], slot: int | None = None
    ) -> list[Tensor]:
        """Where a transfer sent at ``hop`` arrives: the tokens visiting at ``hop + 1`` and the sums of those of
        ``hop``; ``slot``: that slot of the first stack (a grouped ring's gather)."""
        if slot is not None:
            if not self.stack:
                rows = self._stack_rows(0)
                self.stack = [t.new_empty((rows, *t.shape[1:])) for t in self.circulating]
            a, b = self._slot_rows(0, slot)
            return [t[a:b] for t in self.stack]
        rows_next, rows_acc = self._stack_rows(hop + 1), self._stack_rows(hop)
        return _grouped_receive_buffers(self.cfg, hop, num_circulating, [
            ((rows_next if i < num_circulating else rows_acc, *t.shape[1:]), t.dtype) for i, t in enumerate(payload)
        ], payload[0].device)

    def stack_owners(self) -> tuple[Tensor, ...]:
        """The first stack (sources ``r - g + 1 .. r``): the earlier slots arrived, this rank's own tokens go into
        the last."""
        a, b = self._slot_rows(0, self.owners_per_hop - 1)
        for t, own in zip(self.stack, self.circulating, strict=True):
            t[a:b].copy_(own)
        stack, self.stack = tuple(self.stack), []
        return stack

    def unstack(self, slot: int, *stacked: Tensor) -> tuple[Tensor, ...]:
        """Slot ``slot`` of the last stack's sums: one source's rows of each (views)."""
        a, b = self._slot_rows(self.cfg.ring.size // self.owners_per_hop - 1, slot)
        return tuple(t[a:b] for t in stacked)

    def _rows(self, hop: int, ids_TK: Tensor, scores_TK: Tensor) -> HopRows:
        # ``src`` names the visiting rows' source to an expert function's counts (a stack's: its first source's).
        routing = PairRouting.build(ids_TK, self.hop_counts_E[hop], self.cfg.experts_per_rank)
        return HopRows(routing=routing, chunks=self.chunks[hop], src=self._sources(hop)[0],
                       scores_S=torch.index_select(scores_TK.reshape(-1), 0, routing.order_P))

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
        segment_forward(self.cfg, self._rows(hop, ids_TK, scores_TK), x_TH, self.weights, RowSum.of(y_TH))
        return (y_TH,)

    def forward_group(self, group: int, x_TH: Tensor, ids_TK: Tensor, scores_TK: Tensor) -> tuple[Tensor, ...]:
        """The pairs of stack ``group``'s tokens for this rank's experts: its ``y`` partial."""
        return self.forward_hop(group, x_TH, ids_TK, scores_TK)

    def _arriving(self, transfer: RingTransfer, first: int, like_TH: Tensor) -> tuple[RowSum, Callable[[], tuple[Tensor, ...]]]:
        """The visiting tokens' sums arriving with ``transfer`` (its received tensors from ``first`` on) as a
        ``RowSum`` waited for at its first add, and what gives them all (waiting if nothing added)."""
        arrived = functools.cache(lambda: _arrived_sums(transfer, first))
        return RowSum.arriving(self.cfg.sum_dtype(like_TH), lambda: arrived()[0]), arrived

    @_drains(_incoming_sums)
    def forward_hop_into(self, hop: int, transfer: RingTransfer, first: int, x_TH: Tensor, ids_TK: Tensor,
                         scores_TK: Tensor) -> tuple[Tensor, ...]:
        """``forward_hop`` adding into the visiting tokens' ``y`` sums arriving with ``transfer`` (as
        ``ExpertRoutingStep.backward_hop_into``): no partial of its own; returns those sums, now with this hop's."""
        y, arrived = self._arriving(transfer, first, x_TH)
        segment_forward(self.cfg, self._rows(hop, ids_TK, scores_TK), x_TH, self.weights, y)
        return arrived()

    def forward_group_into(self, group: int, transfer: RingTransfer, first: int, x_TH: Tensor, ids_TK: Tensor,
                           scores_TK: Tensor) -> tuple[Tensor, ...]:
        return self.forward_hop_into(group, transfer, first, x_TH, ids_TK, scores_TK)

    @_drains(_token_partials)
    def backward_hop(
        self, hop: int, x_TH: Tensor, ids_TK: Tensor, scores_TK: Tensor, dy_TH: Tensor
    ) -> tuple[Tensor, ...]:
        rows = self._rows(hop, ids_TK, scores_TK)
        dx_TH = self._token_sum(x_TH)
        ds_S = torch.empty(scores_TK.numel(), dtype=ACC_DTYPE, device=x_TH.device)
        segment_backward(self.cfg, rows, x_TH, self.weights, dy_TH, RowSum.of(dx_TH), ds_S, self.dw)
        return dx_TH, self._scores_grad(rows, ds_S, scores_TK)

    def backward_group(
        self, group: int, x_TH: Tensor, ids_TK: Tensor, scores_TK: Tensor, dy_TH: Tensor
    ) -> tuple[Tensor, ...]:
        """The pairs of stack ``group``'s tokens for this rank's experts (recomputed per chunk): their ``dx``
        and ``d_scores`` partials; the experts' weight gradients stay here."""
        return self.backward_hop(group, x_TH, ids_TK, scores_TK, dy_TH)

    @_drains(_incoming_sums)
    def backward_hop_into(self, hop: int, transfer: RingTransfer, first: int, x_TH: Tensor, ids_TK: Tensor,
                          scores_TK: Tensor, dy_TH: Tensor) -> tuple[Tensor, ...]:
        """``backward_hop`` adding into the visiting tokens' ``dx`` and ``d_scores`` sums arriving with
        ``transfer``; returns them. A pair's score gradient is written on its expert's rank only, so on a ring the
        arriving ``d_scores`` are zero at this rank's pairs: added, they are exact (the stand-in group, whose every
        hop meets rank 0's own pairs, adds them up as the partials did before)."""
        rows = self._rows(hop, ids_TK, scores_TK)
        dx, arrived = self._arriving(transfer, first, x_TH)
        ds_S = torch.empty(scores_TK.numel(), dtype=ACC_DTYPE, device=x_TH.device)
        segment_backward(self.cfg, rows, x_TH, self.weights, dy_TH, dx, ds_S, self.dw)
        dx_TH, ds_TK = arrived()
        a, b = self._own_range(rows)
        ds_TK.view(-1).index_add_(0, rows.routing.order_P[a:b], ds_S[a:b].to(ds_TK.dtype))
        return dx_TH, ds_TK

    def backward_group_into(self, group: int, transfer: RingTransfer, first: int, x_TH: Tensor, ids_TK: Tensor,
                            scores_TK: Tensor, dy_TH: Tensor) -> tuple[Tensor, ...]:
        return self.backward_hop_into(group, transfer, first, x_TH, ids_TK, scores_TK, dy_TH)

    @_drains(_no_activations)
    def recompute_hop(self, hop: int, x_TH: Tensor, ids_TK: Tensor, scores_TK: Tensor) -> HopActivations:
        rows = self._rows(hop, ids_TK, scores_TK)
        return HopActivations(chunks=[recompute_chunk(self.cfg, rows, c, x_TH, self.weights) for c in rows.chunks])

    @_drains(_token_partials)
    def vjp_hop(
        self, hop: int, acts: HopActivations, x_TH: Tensor, ids_TK: Tensor, scores_TK: Tensor, dy_TH: Tensor
    ) -> tuple[Tensor, ...]:
        rows = self._rows(hop, ids_TK, scores_TK)
        dx_TH = self._token_sum(x_TH)
        ds_S = torch.empty(scores_TK.numel(), dtype=ACC_DTYPE, device=x_TH.device)
        while acts.chunks:
            chunk_vjp(self.cfg, rows, acts.chunks, x_TH, dy_TH, RowSum.of(dx_TH), ds_S, self.dw)
        acts.chunks.clear()
        return dx_TH, self._scores_grad(rows, ds_S, scores_TK)

    @_drains(_trailing)
    def finish(self, *trailing: Tensor) -> tuple[Tensor, ...]:
        if self.owners_per_hop > 1:  # the g sums returned to this source, one per residue class of ranks
            n = len(trailing) // self.owners_per_hop
            trailing = tuple(functools.reduce(torch.add, trailing[i::n]) for i in range(n))
        # The returned y (forward) or dx (backward) in the tokens' dtype; d_scores has it already.
        token_sum, *rest = trailing
        token_sum = token_sum.to(self.circulating[0].dtype)
        if not self.backward:
            return (token_sum, *rest)
        grads = unpack_grads(self.cfg.grouped, self.dw.result(), self.grads_like, self.given_weights)
        return (token_sum, *rest, *grads)


RingStep = ExpertRoutingStep | TokenRoutingStep


def clamped_ids(num_experts: int, topk_ids_TK: Tensor) -> tuple[Tensor, Tensor]:
    """Ids safe to count with, and a ``(1,)`` int64 flag: does this rank hold ids outside ``[0, E)``?"""
    bad = ((topk_ids_TK < 0) | (topk_ids_TK >= num_experts)).any().to(torch.int64).reshape(1)
    return topk_ids_TK.clamp(0, num_experts - 1), bad

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
- ``TokenRoutingStep`` (``token_routing_step``): experts stay, token partitions circulate and their output sums
  one hop behind.

What a hop computes on its pairs, chunk by chunk (forward, recomputed backward, scores before or after F,
the sums across hops), is ``segment_compute``; this module binds it to the ring's hops and transfers.

A step plans from counts every rank agreed on (``runtime.agreement``; a step driven directly on a ring of
one counts its own). Inside a multi-rank ``transport.RingRun`` the step never raises out of a hop: the
first exception marks the run failed, and its setup, hops and ``finish`` then return zeros of the
partials' shapes without computing, so the program completes every transfer (``ring_step.drains``).

Legend: T tokens, H hidden, K top-k, P = T*K pairs, C rows of a chunk, N ranks, E experts, E_l = E / N.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from relay_compile.grouped_gemm import grouped_mm_supported
from relay_compile.routing import PairOrder, PairRouting, plan_chunks, split_experts, split_owners
from relay_compile.runtime.agreement import StepCounts
from relay_compile.runtime.chunk_graphs import PaddedChunks
from relay_compile.runtime.equal_groups import EqualGroups
from relay_compile.runtime.ring_step import (
    arrived_sums,
    drains,
    grouped_receive_buffers,
    guarded_setup,
    incoming_sums,
    local_counts,
    no_activations,
    no_partials,
    sum_slots,
    trailing_as_is,
    unallocated_zeros,
)
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
from relay_compile.runtime.token_routing_step import TokenRoutingStep
from relay_compile.runtime.transport import RingTransfer
from relay_compile.runtime.weight_grads import WeightGrads, grads_like, pack_weights, unpack_grads


def _weight_partials(step: RingStep, hop: int, *args: object) -> tuple[Tensor, ...]:
    """Zero weight-gradient partials (expert routing backward): one per packed weight's gradient
    (``grads_like``), in the dtype a computed partial of ``hop`` has (what travels must have the same bytes on
    every rank)."""
    assert isinstance(step, ExpertRoutingStep)
    return tuple(unallocated_zeros(g, ExpertRoutingStep.partial_dtype(step.cfg, hop, g)) for g in step.grads_like)


def _stack_partials(step: RingStep, group: int, *args: object) -> tuple[Tensor, ...]:
    """Zero weight-gradient partials of an owner stack (a grouped backward hop), in the dtype a computed one of
    ``group`` has (group 0's start the travelling sums)."""
    assert isinstance(step, ExpertRoutingStep)
    return tuple(unallocated_zeros(g, ExpertRoutingStep.partial_dtype(step.cfg, group, g))
                 for g in step.stack_grads_like)


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
        guarded_setup(self, ExpertRoutingStep._plan, topk_ids_TK, topk_scores_TK, counts, projections, order, sum_TH)

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
        return grouped_receive_buffers(self.cfg, hop, num_circulating, [(t.shape, t.dtype) for t in payload],
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

    @drains(no_partials)
    def forward_hop(self, hop: int, *weights: Tensor) -> tuple[Tensor, ...]:
        segment_forward(self.cfg, self._rows(hop), self.x_TH, weights, self.y)
        return ()

    @drains(no_partials)
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

    @drains(_weight_partials)
    def backward_hop(self, hop: int, *weights: Tensor) -> tuple[Tensor, ...]:
        dw = WeightGrads(self.grads_like, self.cfg.acc_dtype)
        assert self.grad_y_TH is not None
        segment_backward(self.cfg, self._rows(hop), self.x_TH, weights, self.grad_y_TH, self.dx, self.ds_S, dw)
        return self._weight_grads(hop, dw)

    @drains(incoming_sums)
    def backward_hop_into(self, hop: int, transfer: RingTransfer, first: int, *weights: Tensor) -> tuple[Tensor, ...]:
        """``backward_hop`` whose weight gradients add into the sums travelling in ``transfer`` (its received
        tensors from position ``first``): waited for right before the hop's first weight-gradient GEMM, so
        the hop keeps no partial of its own; returns those sums, now including this hop."""
        dw = WeightGrads(self.grads_like, self.cfg.acc_dtype, into=lambda: arrived_sums(transfer, first))
        assert self.grad_y_TH is not None
        segment_backward(self.cfg, self._rows(hop), self.x_TH, weights, self.grad_y_TH, self.dx, self.ds_S, dw)
        return dw.result()

    @drains(_stack_partials)
    def backward_group(self, group: int, *stacked: Tensor) -> tuple[Tensor, ...]:
        """The pairs of this rank that meet owner stack ``group``; the stack's gradient partials (group 0's
        start the travelling sums: in their dtype, ``partial_dtype``)."""
        dw = WeightGrads(self.stack_grads_like, self.cfg.acc_dtype)
        assert self.grad_y_TH is not None
        segment_backward(self.cfg, self._group_rows(group), self.x_TH, stacked, self.grad_y_TH, self.dx, self.ds_S,
                         dw)
        return dw.result([self.partial_dtype(self.cfg, group, g) for g in self.stack_grads_like])

    @drains(incoming_sums)
    def backward_group_into(self, group: int, transfer: RingTransfer, first: int, *stacked: Tensor
                            ) -> tuple[Tensor, ...]:
        """``backward_group`` adding into the stack's gradient sums arriving with ``transfer`` (as
        ``backward_hop_into``)."""
        dw = WeightGrads(self.stack_grads_like, self.cfg.acc_dtype, into=lambda: arrived_sums(transfer, first))
        assert self.grad_y_TH is not None
        segment_backward(self.cfg, self._group_rows(group), self.x_TH, stacked, self.grad_y_TH, self.dx, self.ds_S,
                         dw)
        return dw.result()

    @drains(no_activations)
    def recompute_hop(self, hop: int, *weights: Tensor) -> HopActivations:
        rows = self._rows(hop)
        return HopActivations(chunks=[recompute_chunk(self.cfg, rows, c, self.x_TH, weights) for c in rows.chunks])

    @drains(_weight_partials)
    def vjp_hop(self, hop: int, acts: HopActivations, *weights: Tensor) -> tuple[Tensor, ...]:
        dw = WeightGrads(self.grads_like, self.cfg.acc_dtype)
        assert self.grad_y_TH is not None
        rows = self._rows(hop)
        while acts.chunks:
            chunk_vjp(self.cfg, rows, acts.chunks, self.x_TH, self.grad_y_TH, self.dx, self.ds_S, dw)
        acts.chunks.clear()
        return self._weight_grads(hop, dw)

    @drains(trailing_as_is)
    def finish(self, *trailing: Tensor) -> tuple[Tensor, ...]:
        dtype = self.x_TH.dtype
        if self.grad_y_TH is None:
            y_TH = self.y.finish(dtype)
            return (y_TH,) if self.projections_PU is None else (y_TH, self.projections_PU)
        if self.equal is not None:
            self.equal.scores_grad_into(self.ds_S1)
        ds_P = torch.empty_like(self.ds_S).index_copy_(0, self.routing.order_P, self.ds_S)
        if self.owners_per_hop > 1:  # the g sums returned to this owner
            trailing = sum_slots(trailing, self.owners_per_hop)
        return (self.dx.finish(dtype), ds_P.to(self.scores_S.dtype).view(self.topk_shape),
                *unpack_grads(self.cfg.grouped, trailing, self.grads_like, self.given_weights))


RingStep = ExpertRoutingStep | TokenRoutingStep

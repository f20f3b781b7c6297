"""``TokenRoutingStep``: token routing's ring step. Experts stay; at hop ``h`` rank ``r`` holds the tokens of source
``(r - h) mod N`` and computes their pairs for its own experts. The output (backward: ``dx``, ``d_scores``) sums
travel one hop behind the tokens, and every hop but the first adds into them as they arrive (``forward_hop_into``,
``backward_hop_into``: the program pass ``sum_in_place``); weight gradients accumulate locally. A grouped ring
holds ``g`` sources' tokens per hop, stacked row after row and computed as one visiting partition; their sums trail
the stacks and each slot returns to its source.

Legend: T tokens, H hidden, K top-k, P = T*K pairs, N ranks, E_l = E / N.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from relay_compile.routing import PairRouting, plan_chunks, split_experts
from relay_compile.runtime.agreement import StepCounts
from relay_compile.runtime.row_sum import RowSum
from relay_compile.runtime.ring_step import (
    arrived_sums,
    drains,
    grouped_receive_buffers,
    guarded_setup,
    incoming_sums,
    local_counts,
    no_activations,
    sum_slots,
    trailing_as_is,
    unallocated_zeros,
)
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
from relay_compile.runtime.transport import RingTransfer
from relay_compile.runtime.weight_grads import WeightGrads, grads_like, pack_weights, unpack_grads


def _token_partials(step: TokenRoutingStep, hop: int, *args: object) -> tuple[Tensor, ...]:
    """Zero partials of the visiting tokens: ``y`` (forward), ``dx`` and ``d_scores`` (backward)."""
    x_TH, _, scores_TK, *_ = [t for t in args if isinstance(t, Tensor)]
    y_TH = unallocated_zeros(x_TH, step.cfg.sum_dtype(x_TH))
    return (y_TH, unallocated_zeros(scores_TK)) if step.backward else (y_TH,)


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
        guarded_setup(self, TokenRoutingStep._plan)

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
        return grouped_receive_buffers(self.cfg, hop, num_circulating, [
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

    @drains(_token_partials)
    def forward_hop(self, hop: int, x_TH: Tensor, ids_TK: Tensor, scores_TK: Tensor) -> tuple[Tensor, ...]:
        y_TH = self._token_sum(x_TH)
        segment_forward(self.cfg, self._rows(hop, ids_TK, scores_TK), x_TH, self.weights, RowSum.of(y_TH))
        return (y_TH,)

    def _arriving(self, transfer: RingTransfer, first: int, like_TH: Tensor
                  ) -> tuple[RowSum, Callable[[], tuple[Tensor, ...]]]:
        """The visiting tokens' sums arriving with ``transfer`` (its received tensors from ``first`` on) as a
        ``RowSum`` waited for at its first add, and what gives them all (waiting if nothing added)."""
        arrived = functools.cache(lambda: arrived_sums(transfer, first))
        return RowSum.arriving(self.cfg.sum_dtype(like_TH), lambda: arrived()[0]), arrived

    @drains(incoming_sums)
    def forward_hop_into(self, hop: int, transfer: RingTransfer, first: int, x_TH: Tensor, ids_TK: Tensor,
                         scores_TK: Tensor) -> tuple[Tensor, ...]:
        """``forward_hop`` adding into the visiting tokens' ``y`` sums arriving with ``transfer`` (as
        ``ExpertRoutingStep.backward_hop_into``): no partial of its own; returns those sums, now with this hop's."""
        y, arrived = self._arriving(transfer, first, x_TH)
        segment_forward(self.cfg, self._rows(hop, ids_TK, scores_TK), x_TH, self.weights, y)
        return arrived()

    @drains(_token_partials)
    def backward_hop(
        self, hop: int, x_TH: Tensor, ids_TK: Tensor, scores_TK: Tensor, dy_TH: Tensor
    ) -> tuple[Tensor, ...]:
        rows = self._rows(hop, ids_TK, scores_TK)
        dx_TH = self._token_sum(x_TH)
        ds_S = torch.empty(scores_TK.numel(), dtype=ACC_DTYPE, device=x_TH.device)
        segment_backward(self.cfg, rows, x_TH, self.weights, dy_TH, RowSum.of(dx_TH), ds_S, self.dw)
        return dx_TH, self._scores_grad(rows, ds_S, scores_TK)

    @drains(incoming_sums)
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

    @drains(no_activations)
    def recompute_hop(self, hop: int, x_TH: Tensor, ids_TK: Tensor, scores_TK: Tensor) -> HopActivations:
        rows = self._rows(hop, ids_TK, scores_TK)
        return HopActivations(chunks=[recompute_chunk(self.cfg, rows, c, x_TH, self.weights) for c in rows.chunks])

    @drains(_token_partials)
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

    # A stack is one visiting partition: a grouped ring's hops are the plain ones, at the stack's index.
    forward_group, forward_group_into = forward_hop, forward_hop_into
    backward_group, backward_group_into = backward_hop, backward_hop_into

    @drains(trailing_as_is)
    def finish(self, *trailing: Tensor) -> tuple[Tensor, ...]:
        if self.owners_per_hop > 1:  # the g sums returned to this source
            trailing = sum_slots(trailing, self.owners_per_hop)
        # The returned y (forward) or dx (backward) in the tokens' dtype; d_scores has it already.
        token_sum, *rest = trailing
        token_sum = token_sum.to(self.circulating[0].dtype)
        if not self.backward:
            return (token_sum, *rest)
        grads = unpack_grads(self.cfg.grouped, self.dw.result(), self.grads_like, self.given_weights)
        return (token_sum, *rest, *grads)

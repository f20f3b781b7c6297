"""``AllToAllStep``: one call of a block run as its all-to-all would run it, where the ring would not pay.

The cost model (``runtime.cost_model.choose``) keeps a block's all-to-all where the ring is predicted slower
(small token counts): a call of the op, where the ring is predicted slower than this step itself
(``kept="op"``: ``Calibration.op_a2a_ratio`` times the traced all-to-all). Where the token count is dynamic (or
``ring_moe`` is called directly) the region is still one ``relaymoe::ring_moe`` call (the decision is made per
call from the agreed table, so a changing token count may cross it, on every rank alike); this step is what
the op then runs, with the region's own expert function:

    forward:   pairs sorted by expert; their rows dispatched to the experts' owners (one all-to-all, and one
               of their scores); the owner computes its experts on every row it received at once (the
               ``segment_compute`` of one hop, over the received rows as tokens with one pair each); the
               outputs combined back (one all-to-all) and summed into ``y`` per token.
    backward:  the rows, the output gradients and the scores dispatched again (one all-to-all: the scores'
               bytes ride as extra columns of the concatenated rows, ``_value_columns``; nothing was saved by
               the forward, as in the ring); the owner recomputes and takes the vector-Jacobian product on all
               its rows; ``dx`` rows and score gradients combined back; the weight gradients are complete on
               the owner.

Beside these, each call exchanges the counts (to learn what it receives) and a failure status: five all-to-alls
per forward and five per backward. Only the backward's dispatch packs: there the rows are concatenated anyway,
while packing the forward's rows or the combine's ``dx`` would hold a second copy of them during the exchange.
Where a score's bytes do not fill whole columns of the rows' dtype (fp32 scores beside fp64 rows), the scores
take an all-to-all of their own.

It builds the top-k-expanded buffers the ring avoids (though not autograd's saved copies of them). A failure in the owner's compute sends zeros, completes the exchanges and
raises on its rank; the peers learn of it from a failure status exchanged beside the combine (read at once on
the CPU, else at the group's next agreement), as a ring's peers do (``transport.RingRun``).

Legend: T tokens, H hidden, K top-k, P = T*K pairs sent, R rows received, N ranks, E_l experts per rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from relay_compile.routing import Chunk, PairOrder, PairRouting, plan_chunks, split_experts
from relay_compile.runtime.agreement import StepCounts, remember_status
from relay_compile.runtime.row_sum import RowSum
from relay_compile.runtime.segment_compute import ACC_DTYPE, HopRows, RingStepConfig, segment_backward, segment_forward
from relay_compile.runtime.transport import RingGroup, RingPeerError, peer_failure, status_read_at_once
from relay_compile.runtime.weight_grads import WeightGrads, grads_like, unpack_grads


def _exchange(ring: RingGroup, send: Tensor, send_splits: list[int], recv_splits: list[int]) -> Tensor:
    """``all_to_all_single`` on the ring's group: rows ``send_splits[o]`` to rank ``o``, ``recv_splits[s]`` from
    rank ``s`` (a ring of one: ``send`` itself)."""
    if ring.group is None:
        return send
    out = send.new_empty((sum(recv_splits), *send.shape[1:]))
    dist.all_to_all_single(out, send.contiguous(), recv_splits, send_splits, group=ring.group)
    return out


def _value_columns(values_P: Tensor, dtype: torch.dtype) -> Tensor | None:
    """One value per row as columns of ``dtype`` that hold the value's bytes (reinterpreted, not converted), to
    ride in a concatenation of rows; None where a value's bytes do not fill whole columns."""
    width, rest = divmod(values_P.element_size(), torch.empty((), dtype=dtype).element_size())
    if rest or not width:
        return None
    return values_P.contiguous().view(dtype).view(-1, width)


def _split_values(packed_RC: Tensor, columns: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``_value_columns`` undone on what arrived: the rows (a view) and the values in ``dtype``. (A fresh
    contiguous copy of the value columns: with one row or none, ``contiguous()`` and a plain ``clone()`` keep the
    slice's offset and row stride, which need not suit the wider dtype.)"""
    values = packed_RC[:, columns:].clone(memory_format=torch.contiguous_format)
    return packed_RC[:, :columns], values.view(dtype).view(-1)


class AllToAllStep:
    """One forward or backward of the block through all-to-alls (module docstring).

    ``counts``: the agreed counts, every rank's (``runtime.agreement``). ``packed``: the weights in the expert
    function's packed layout; ``weights``: as given (the gradients return in their layout). ``order``: this
    rank's pairs sorted already (``runtime.queued_ahead``).
    """

    def __init__(self, cfg: RingStepConfig, x_TH: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor,
                 weights: Sequence[Tensor], grad_y_TH: Tensor | None, *, counts: StepCounts, counts_E: Tensor,
                 packed: list[Tensor], order: PairOrder | None = None) -> None:
        self.cfg, self.x_TH, self.scores_TK, self.grad_y_TH = cfg, x_TH, topk_scores_TK, grad_y_TH
        self.given_weights, self.packed = list(weights), packed
        ring, e_l = cfg.ring, cfg.experts_per_rank
        own_counts = counts.counts_NE[ring.rank]
        assert own_counts is not None, "ring_moe: a rank knows its own counts"
        # The send side: this rank's pairs sorted by expert, hence by owner.
        self.send = PairRouting.build(topk_ids_TK, own_counts, e_l, order)
        self.scores_S = None if order is None else order.scores_S
        self.send_splits = [b - a for a, b in map(self.send.owner_range, range(ring.size))]
        # The receive side: from each source, its rows for this rank's experts, grouped by expert, as the
        # dispatchers learn it: an all-to-all of the counts (exact also on the bench's stand-in group, whose
        # peers mirror this rank under a relabeling that a table of everyone's counts does not follow).
        # NOTE: device-to-host sync, once per call (the agreement's table was the other).
        per_source_L = _exchange(ring, counts_E, [e_l] * ring.size, [e_l] * ring.size).view(ring.size, e_l).tolist()
        self.recv_splits = [sum(rows) for rows in per_source_L]
        self.recv_plan = self._received_plan(per_source_L)

    def _received_plan(self, per_source_L: list[list[int]]) -> tuple[PairRouting, list[Chunk]] | None:
        """The received rows as one hop's tokens with one pair each: their routing, sorted by expert, and its
        chunks (None: none received)."""
        cfg, device = self.cfg, self.x_TH.device
        total = sum(self.recv_splits)
        if total == 0:
            return None
        e_l, rank = cfg.experts_per_rank, cfg.ring.rank
        counts_SL = torch.tensor([c for rows in per_source_L for c in rows], dtype=torch.int64,
                                 pin_memory=device.type == "cuda").to(device, non_blocking=True)
        local_R = torch.arange(e_l, device=device).repeat(cfg.ring.size)
        ids_R1 = (torch.repeat_interleave(local_R, counts_SL, output_size=total) + rank * e_l).unsqueeze(1)
        counts_E = [0] * cfg.num_experts
        for rows in per_source_L:
            for e, c in enumerate(rows):
                counts_E[rank * e_l + e] += c
        routing = PairRouting.build(ids_R1, counts_E, e_l)
        start, _ = routing.owner_range(rank)
        (chunks,) = plan_chunks([split_experts(routing.rows_per_expert(rank), start, cfg.max_hop_rows)], e_l, device)
        return routing, chunks

    def _received_rows(self, scores_R: Tensor) -> HopRows:
        """What ``segment_compute`` runs on: the received rows with the scores that arrived beside them."""
        assert self.recv_plan is not None
        routing, chunks = self.recv_plan
        return HopRows(routing=routing, chunks=chunks, src=self.cfg.ring.rank, scores_S=scores_R[routing.order_P])

    def _dispatch(self, *sources_TC: Tensor) -> tuple[Tensor, Tensor]:
        """The sources' rows of this rank's pairs (in sorted-pair order, side by side) and their scores to the
        owners: what this rank received. Where the rows are a concatenation anyway (the backward's x and dy), the
        scores join it as columns and one all-to-all moves both; a single source's rows are sent as gathered
        and the scores apart (packing them would copy the rows)."""
        tok_P, ring = self.send.tokens_P, self.cfg.ring
        scores_P = self.scores_TK.reshape(-1)[self.send.order_P] if self.scores_S is None else self.scores_S
        columns = _value_columns(scores_P, sources_TC[0].dtype) if len(sources_TC) > 1 else None
        if columns is not None:
            packed = torch.cat([*(s[tok_P] for s in sources_TC), columns], dim=1)
            received = _exchange(ring, packed, self.send_splits, self.recv_splits)
            return _split_values(received, sum(s.shape[1] for s in sources_TC), scores_P.dtype)
        rows_PC = sources_TC[0][tok_P] if len(sources_TC) == 1 else torch.cat([s[tok_P] for s in sources_TC], dim=1)
        return (_exchange(ring, rows_PC, self.send_splits, self.recv_splits),
                _exchange(ring, scores_P, self.send_splits, self.recv_splits))

    def _combine(self, *received: Tensor, failed: bool) -> list[Tensor]:
        """What the owner computed, back to the sources (in their sorted-pair order), with the failure status."""
        ring = self.cfg.ring
        back = [_exchange(ring, t, self.recv_splits, self.send_splits) for t in received]
        if ring.group is not None:
            own = torch.full((ring.size,), ring.rank + 1 if failed else 0, dtype=torch.int64, device=self.x_TH.device)
            heard = _exchange(ring, own, [1] * ring.size, [1] * ring.size).max().reshape(1)
            self._settle(heard)
        return back

    def _settle(self, heard: Tensor) -> None:
        """A peer's failure: raised now where reading the status is free, else at the group's next agreement."""
        if not status_read_at_once(heard.device):
            remember_status(self.cfg.ring, heard)
            return
        failed = int(heard.item()) - 1
        if failed >= 0 and failed != self.cfg.ring.rank:
            raise RingPeerError(peer_failure(failed, self.cfg.ring.rank, "this all-to-all block"))

    def forward(self) -> tuple[Tensor]:
        x_TH, cfg = self.x_TH, self.cfg
        recv_RH, scores_R = self._dispatch(x_TH)
        y_RH = torch.zeros_like(recv_RH)
        error = None
        if self.recv_plan is not None:
            try:
                segment_forward(cfg, self._received_rows(scores_R), recv_RH, self.packed, RowSum.of(y_RH))
            except Exception as e:  # noqa: BLE001 -- the peers still wait for the combine: zeros, then raise
                error, y_RH = e, torch.zeros_like(recv_RH)
        del recv_RH
        (back_PH,) = self._combine(y_RH, failed=error is not None)
        if error is not None:
            raise error
        y = RowSum(x_TH, cfg.sum_dtype(x_TH))
        y.add_(self.send.tokens_P, back_PH)
        return (y.finish(x_TH.dtype),)

    def backward(self) -> tuple[Tensor, ...]:
        x_TH, cfg, h = self.x_TH, self.cfg, self.x_TH.shape[1]
        assert self.grad_y_TH is not None
        tok_P = self.send.tokens_P
        recv, scores_R = self._dispatch(x_TH, self.grad_y_TH)
        recv_RH, dy_RH = recv[:, :h], recv[:, h:]
        dx_RH = torch.zeros_like(recv_RH)
        ds_R = torch.zeros(recv.shape[0], dtype=ACC_DTYPE, device=x_TH.device)
        like = grads_like(cfg.grouped, self.packed, self.given_weights)
        dw = WeightGrads(like, cfg.acc_dtype)
        error = None
        if self.recv_plan is not None:
            rows = self._received_rows(scores_R)
            ds_S = torch.empty(recv.shape[0], dtype=ACC_DTYPE, device=x_TH.device)
            try:
                segment_backward(cfg, rows, recv_RH, self.packed, dy_RH, RowSum.of(dx_RH), ds_S, dw)
                ds_R[rows.routing.order_P] = ds_S
            except Exception as e:  # noqa: BLE001 -- as in forward
                error, dx_RH, ds_R = e, torch.zeros_like(dx_RH), torch.zeros_like(ds_R)
        del recv, recv_RH, dy_RH
        back_dx_PH, back_ds_P = self._combine(dx_RH, ds_R, failed=error is not None)
        if error is not None:
            raise error
        dx = RowSum(x_TH, cfg.sum_dtype(x_TH))
        dx.add_(tok_P, back_dx_PH)
        ds_P = torch.zeros_like(back_ds_P).index_copy_(0, self.send.order_P, back_ds_P)
        d_weights = unpack_grads(cfg.grouped, dw.result(), like, self.given_weights)
        return (dx.finish(x_TH.dtype), ds_P.to(self.scores_TK.dtype).view(self.scores_TK.shape), *d_weights)

"""What one hop computes: the (token, expert) pairs that meet on this rank, in bounded chunks.

A ``RingStep`` binds one call of the ring (one forward or one backward of one MoE block) to the ring
programs: the programs say *when* (hop order, transfers), the step says *what* (which pairs, which rows).

- ``ExpertRoutingStep``: tokens stay; at hop ``h`` rank ``r`` holds the weights of owner ``(r - h) mod N`` and
  computes its own pairs for that owner. Backward returns the owner's weight-gradient partial, which travels
  one hop behind the weights (the program adds it to the incoming accumulator).
- ``TokenRoutingStep``: experts stay; at hop ``h`` rank ``r`` holds the tokens of source ``(r - h) mod N`` and
  computes their pairs for its own experts. The output (backward: ``dx``, ``d_scores``) accumulator travels
  one hop behind the tokens; weight gradients accumulate locally.

Per chunk, forward: ``y[t] += score * F(x[t])``; backward recomputes ``F`` on the chunk, takes its
vector-Jacobian product and releases everything before the next chunk (hop-scoped rematerialization).
Accumulators keep the dtype of what they accumulate (bf16 sums like the all-to-all layer's combine and
its autograd, at half the bytes of fp32); the per-pair score gradients are reduced in fp32.

Legend: T tokens, H hidden, K top-k, P = T*K pairs, C rows of a chunk, N ranks, E experts, E_l = E / N.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from relay_compile.experts import ExpertFn
from relay_compile.routing import PairRouting
from relay_compile.runtime.transport import RingGroup, all_gather_rows, all_reduce_max

# Dtype of the per-pair score-gradient reductions (a dot product over H per pair).
ACC_DTYPE = torch.float32


class RingInputError(ValueError):
    """A rank's inputs failed the step's validation; raised on every rank so none waits on a transfer."""


@dataclass(frozen=True, kw_only=True)
class RingStepConfig:
    """What a step needs besides tensors: the expert function, the ring, and the static sizes."""

    expert_fn: ExpertFn
    ring: RingGroup
    num_experts: int
    max_hop_rows: int | None


@dataclass(kw_only=True)
class HopActivations:
    """A hop's recomputed chunks with their autograd graphs alive (only when remat is off)."""

    chunks: list[tuple[Tensor, list[Tensor], Tensor, Tensor, Tensor]] = field(default_factory=list)


def _chunk_inputs(
    cfg: RingStepConfig, routing: PairRouting, owner: int, src: int, c0: int, c1: int
) -> tuple[Tensor, Tensor, Tensor, list[int]]:
    """Pair positions ``(C,)``, token rows ``(C,)``, ``counts_NL`` and ``splits_N`` of one chunk."""
    pos_C = routing.order_P[c0:c1]
    counts_NL = torch.zeros(cfg.ring.size, routing.experts_per_rank, dtype=torch.int64, device=pos_C.device)
    counts_NL[src] = routing.chunk_counts(owner, c0, c1)
    splits_N = [0] * cfg.ring.size
    splits_N[src] = c1 - c0
    return pos_C, pos_C // routing.top_k, counts_NL, splits_N


def segment_forward(
    cfg: RingStepConfig, routing: PairRouting, owner: int, src: int,
    x_TH: Tensor, scores_P: Tensor, weights: Sequence[Tensor], y_TH: Tensor,
) -> None:
    """``y[t] += scores[p] * F_owner(x[t])`` for the pairs ``p = (t, k)`` of ``owner``'s experts."""
    for c0, c1 in routing.chunks(owner, cfg.max_hop_rows):
        pos_C, tok_C, counts_NL, splits_N = _chunk_inputs(cfg, routing, owner, src, c0, c1)
        out_CH = cfg.expert_fn(x_TH[tok_C], counts_NL, splits_N, weights)
        y_TH.index_add_(0, tok_C, (out_CH * scores_P[pos_C, None]).to(y_TH.dtype))


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
    cfg: RingStepConfig, routing: PairRouting, owner: int, src: int, c0: int, c1: int,
    x_TH: Tensor, weights: Sequence[Tensor],
) -> tuple[Tensor, list[Tensor], Tensor, Tensor, Tensor]:
    """Rerun ``F`` on one chunk with autograd: ``(x_CH leaf, weight leaves, out_CH, pos_C, tok_C)``."""
    pos_C, tok_C, counts_NL, splits_N = _chunk_inputs(cfg, routing, owner, src, c0, c1)
    x_CH = x_TH[tok_C].detach().requires_grad_()
    w_leaves = [w.detach().requires_grad_() for w in weights]
    with _autograd_enabled():
        out_CH = cfg.expert_fn(x_CH, counts_NL, splits_N, w_leaves)
    return x_CH, w_leaves, out_CH, pos_C, tok_C


def _chunk_vjp(
    chunk: tuple[Tensor, list[Tensor], Tensor, Tensor, Tensor],
    scores_P: Tensor, dy_TH: Tensor, dx_TH: Tensor, ds_P: Tensor, dw: list[Tensor],
) -> None:
    """Consume one recomputed chunk: add its ``dx``, ``d_scores`` and weight-gradient contributions."""
    x_CH, w_leaves, out_CH, pos_C, tok_C = chunk
    dy_CH = dy_TH[tok_C]
    ds_P.index_copy_(0, pos_C, (dy_CH.to(ACC_DTYPE) * out_CH.detach().to(ACC_DTYPE)).sum(-1))
    with _autograd_enabled():
        grads = torch.autograd.grad(
            out_CH, [x_CH, *w_leaves], dy_CH * scores_P[pos_C, None].to(dy_CH.dtype), allow_unused=True
        )
    dx_TH.index_add_(0, tok_C, grads[0].to(dx_TH.dtype))
    _accumulate(dw, grads[1:])


def segment_backward(
    cfg: RingStepConfig, routing: PairRouting, owner: int, src: int,
    x_TH: Tensor, scores_P: Tensor, weights: Sequence[Tensor], dy_TH: Tensor,
    dx_TH: Tensor, ds_P: Tensor, dw: list[Tensor],
) -> None:
    """Per chunk of ``owner``'s pairs: recompute, vector-Jacobian product, accumulate, release.

    Uses the expert function's fused ``vjp`` where it has one, else autograd over a recomputed forward.
    """
    fused = getattr(cfg.expert_fn, "vjp", None)
    for c0, c1 in routing.chunks(owner, cfg.max_hop_rows):
        if fused is None:
            _chunk_vjp(_recompute_chunk(cfg, routing, owner, src, c0, c1, x_TH, weights), scores_P, dy_TH, dx_TH,
                       ds_P, dw)
            continue
        pos_C, tok_C, counts_NL, splits_N = _chunk_inputs(cfg, routing, owner, src, c0, c1)
        dx_CH, ds_C, dws = fused(x_TH[tok_C], counts_NL, splits_N, weights, dy_TH[tok_C], scores_P[pos_C])
        ds_P.index_copy_(0, pos_C, ds_C.to(ds_P.dtype))
        dx_TH.index_add_(0, tok_C, dx_CH.to(dx_TH.dtype))
        _accumulate(dw, dws)


def _accumulate(dw: list[Tensor | None], grads: Sequence[Tensor | None]) -> None:
    """``dw[i] += grads[i]``, where ``None`` is zero (the first chunk's gradients are taken as they are)."""
    for i, g in enumerate(grads):
        if g is not None:
            dw[i] = g if dw[i] is None else dw[i].add_(g)


def _weight_grads(dw: list[Tensor | None], weights: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """The accumulated gradients in the weights' dtype; zeros for a weight no pair touched (an empty hop)."""
    return tuple(torch.zeros_like(w) if g is None else g.to(w.dtype) for g, w in zip(dw, weights, strict=True))


class ExpertRoutingStep:
    """Expert routing: ``x`` stays, weight partitions circulate (and their gradients one hop behind)."""

    def __init__(
        self, cfg: RingStepConfig, x_TH: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor,
        weights: Sequence[Tensor], grad_y_TH: Tensor | None = None,
    ) -> None:
        self.cfg, self.x_TH, self.weights = cfg, x_TH, list(weights)
        self.scores_P = topk_scores_TK.reshape(-1)
        self.grad_y_TH = grad_y_TH
        e_l = cfg.num_experts // cfg.ring.size
        ids_TK, bad = _clamped_ids(cfg, topk_ids_TK)
        counts_E = PairRouting.counts(ids_TK, cfg.num_experts)
        any_bad = all_reduce_max(cfg.ring, bad.clone())
        # NOTE: device-to-host sync, once per step: sizes every hop's segment (and reads the error flags).
        local_bad, any_bad, *counts_host = torch.cat([bad, any_bad, counts_E]).tolist()
        _raise_if_bad(cfg, local_bad, any_bad)
        self.routing = PairRouting.build(topk_ids_TK, counts_E, counts_host, e_l)
        if grad_y_TH is None:
            self.y_TH = torch.zeros_like(x_TH)
        else:
            self.dx_TH = torch.zeros_like(x_TH)
            self.ds_P = torch.zeros(self.scores_P.shape, dtype=ACC_DTYPE, device=x_TH.device)

    def initial_circulating(self) -> list[Tensor]:
        return self.weights

    def receive_buffers(self, hop: int, num_circulating: int, payload: Sequence[Tensor]) -> list[Tensor]:
        # Every partition (and its gradient) has the shapes of the local one: checked at the first call.
        return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in payload]

    def _owner(self, hop: int) -> int:
        return (self.cfg.ring.rank - hop) % self.cfg.ring.size

    def forward_hop(self, hop: int, *weights: Tensor) -> tuple[Tensor, ...]:
        segment_forward(
            self.cfg, self.routing, self._owner(hop), self.cfg.ring.rank, self.x_TH, self.scores_P, weights,
            self.y_TH,
        )
        return ()

    def backward_hop(self, hop: int, *weights: Tensor) -> tuple[Tensor, ...]:
        dw: list[Tensor | None] = [None] * len(weights)
        assert self.grad_y_TH is not None
        segment_backward(
            self.cfg, self.routing, self._owner(hop), self.cfg.ring.rank, self.x_TH, self.scores_P, weights,
            self.grad_y_TH, self.dx_TH, self.ds_P, dw,
        )
        return _weight_grads(dw, weights)

    def recompute_hop(self, hop: int, *weights: Tensor) -> HopActivations:
        owner, rank = self._owner(hop), self.cfg.ring.rank
        return HopActivations(chunks=[
            _recompute_chunk(self.cfg, self.routing, owner, rank, c0, c1, self.x_TH, weights)
            for c0, c1 in self.routing.chunks(owner, self.cfg.max_hop_rows)
        ])

    def vjp_hop(self, hop: int, acts: HopActivations, *weights: Tensor) -> tuple[Tensor, ...]:
        dw: list[Tensor | None] = [None] * len(weights)
        assert self.grad_y_TH is not None
        for chunk in acts.chunks:
            _chunk_vjp(chunk, self.scores_P, self.grad_y_TH, self.dx_TH, self.ds_P, dw)
        acts.chunks.clear()
        return _weight_grads(dw, weights)

    def finish(self, *trailing: Tensor) -> tuple[Tensor, ...]:
        if self.grad_y_TH is None:
            return (self.y_TH,)
        ds_TK = self.ds_P.to(self.scores_P.dtype).view(self.x_TH.shape[0], -1)
        return (self.dx_TH, ds_TK, *trailing)


class TokenRoutingStep:
    """Token routing: experts stay, token partitions circulate (and their accumulators one hop behind)."""

    def __init__(
        self, cfg: RingStepConfig, x_TH: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor,
        weights: Sequence[Tensor], grad_y_TH: Tensor | None = None,
    ) -> None:
        self.cfg, self.weights = cfg, list(weights)
        self.circulating = [x_TH, topk_ids_TK, topk_scores_TK]
        if grad_y_TH is not None:
            self.circulating.append(grad_y_TH)
            self.dw: list[Tensor | None] = [None] * len(weights)
        self.backward = grad_y_TH is not None
        # One small collective per step: every rank learns every partition's size and per-expert counts,
        # so receive buffers and segments are sized on the host without syncing in the hop loop.
        ids_TK, bad = _clamped_ids(cfg, topk_ids_TK)
        row = torch.cat([
            torch.tensor([x_TH.shape[0]], dtype=torch.int64, device=x_TH.device),
            bad,
            PairRouting.counts(ids_TK, cfg.num_experts),
        ])
        table_NR = all_gather_rows(cfg.ring, row)
        # NOTE: device-to-host sync, once per step.
        table_host = table_NR.tolist()
        _raise_if_bad(cfg, table_host[cfg.ring.rank][1], max(r[1] for r in table_host))
        # Per source rank: its token count, then its pairs per global expert.
        self.counts_NE = table_NR[:, 2:]
        self.rows_N = [r[0] for r in table_host]
        self.counts_host_NE = [r[2:] for r in table_host]

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

    def _routing(self, hop: int, ids_TK: Tensor) -> PairRouting:
        src = self._source(hop)
        return PairRouting.build(
            ids_TK, self.counts_NE[src], self.counts_host_NE[src], self.cfg.num_experts // self.cfg.ring.size
        )

    def forward_hop(self, hop: int, x_TH: Tensor, ids_TK: Tensor, scores_TK: Tensor) -> tuple[Tensor, ...]:
        y_TH = torch.zeros_like(x_TH)
        segment_forward(
            self.cfg, self._routing(hop, ids_TK), self.cfg.ring.rank, self._source(hop), x_TH,
            scores_TK.reshape(-1), self.weights, y_TH,
        )
        return (y_TH,)

    def backward_hop(
        self, hop: int, x_TH: Tensor, ids_TK: Tensor, scores_TK: Tensor, dy_TH: Tensor
    ) -> tuple[Tensor, ...]:
        dx_TH = torch.zeros_like(x_TH)
        ds_P = torch.zeros(scores_TK.numel(), dtype=ACC_DTYPE, device=x_TH.device)
        segment_backward(
            self.cfg, self._routing(hop, ids_TK), self.cfg.ring.rank, self._source(hop), x_TH,
            scores_TK.reshape(-1), self.weights, dy_TH, dx_TH, ds_P, self.dw,
        )
        return dx_TH, ds_P.to(scores_TK.dtype).view(scores_TK.shape)

    def recompute_hop(self, hop: int, x_TH: Tensor, ids_TK: Tensor, scores_TK: Tensor) -> HopActivations:
        routing, rank, src = self._routing(hop, ids_TK), self.cfg.ring.rank, self._source(hop)
        return HopActivations(chunks=[
            _recompute_chunk(self.cfg, routing, rank, src, c0, c1, x_TH, self.weights)
            for c0, c1 in routing.chunks(rank, self.cfg.max_hop_rows)
        ])

    def vjp_hop(
        self, hop: int, acts: HopActivations, x_TH: Tensor, ids_TK: Tensor, scores_TK: Tensor, dy_TH: Tensor
    ) -> tuple[Tensor, ...]:
        dx_TH = torch.zeros_like(x_TH)
        ds_P = torch.zeros(scores_TK.numel(), dtype=ACC_DTYPE, device=x_TH.device)
        for chunk in acts.chunks:
            _chunk_vjp(chunk, scores_TK.reshape(-1), dy_TH, dx_TH, ds_P, self.dw)
        acts.chunks.clear()
        return dx_TH, ds_P.to(scores_TK.dtype).view(scores_TK.shape)

    def finish(self, *trailing: Tensor) -> tuple[Tensor, ...]:
        if not self.backward:
            return trailing
        return (*trailing, *_weight_grads(self.dw, self.weights))


RingStep = ExpertRoutingStep | TokenRoutingStep


def _clamped_ids(cfg: RingStepConfig, topk_ids_TK: Tensor) -> tuple[Tensor, Tensor]:
    """Ids safe to count with, and a ``(1,)`` int64 flag: does this rank hold ids outside ``[0, E)``?"""
    bad = ((topk_ids_TK < 0) | (topk_ids_TK >= cfg.num_experts)).any().to(torch.int64).reshape(1)
    return topk_ids_TK.clamp(0, cfg.num_experts - 1), bad


def _raise_if_bad(cfg: RingStepConfig, local_bad: int, any_bad: int) -> None:
    """Raise on every rank if any rank had bad ids.

    The flags are exchanged before any transfer is posted, so a rank with bad ids never leaves its peers
    waiting on a hop.
    """
    if local_bad:
        raise RingInputError(
            f"ring_moe: topk_ids holds expert ids outside [0, {cfg.num_experts}) on rank {cfg.ring.rank}"
        )
    if any_bad:
        raise RingInputError(
            f"ring_moe: another rank of the EP group passed expert ids outside [0, {cfg.num_experts}); "
            f"rank {cfg.ring.rank} stops with it so no rank waits on a transfer"
        )

"""Routing bookkeeping of one step: pairs sorted once, every hop's segment read from one set of offsets.

A *pair* is one (token, k) slot of ``topk_ids``; ``P = T*K`` pairs, flattened position ``p = t*K + k``.
Sorting the pairs by global expert once per step groups them by owner rank (expert ``e`` lives on rank
``e // E_l``), so the pairs a hop needs are one contiguous range of the sorted order:

    topk_ids = [[3, 0], [1, 3]]   (T=2, K=2, E=4, N=2, E_l=2)
    order_P  = [1, 2, 0, 3]       pairs (t0,k1)->e0, (t1,k0)->e1, (t0,k0)->e3, (t1,k1)->e3
    owner 0: order_P[0:2]         owner 1: order_P[2:4]

The host needs the counts once per step (to size tensors); nothing in the hop loop syncs.

A hop's range is cut into *chunks* aligned to experts (``split_experts``): whole experts packed up to
``max_hop_rows`` rows, an expert with more rows cut into near-equal pieces, so a chunk's grouped GEMMs touch
only its own experts' weights. Every chunk of a step is planned on the host from the counts, and its device
tables (grouped-GEMM offsets, per-expert counts) arrive in one upload per step (``plan_chunks``).

Also here: ``choose_routing``, the paper's Table 2 rule for ``routing="auto"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Routing = Literal["expert", "token"]
ROUTINGS: tuple[str, ...] = ("auto", "expert", "token")


@dataclass(frozen=True, kw_only=True)
class PairOrder:
    """The pairs of ``topk_ids`` sorted by global expert, and their scores in that order: what a step plans from
    its arguments alone, before any count is on the host (``PairRouting.build`` sorts them itself otherwise).

    Attributes:
        order_P: flattened pair positions sorted by expert (stable) ``(P,)``.
        tokens_P: the token of each sorted pair, ``order_P // K`` ``(P,)``.
        scores_S: ``topk_scores`` of each sorted pair ``(P,)``.
    """

    order_P: Tensor
    tokens_P: Tensor
    scores_S: Tensor

    @staticmethod
    def of(topk_ids_TK: Tensor, topk_scores_TK: Tensor) -> PairOrder:
        order_P = torch.argsort(topk_ids_TK.reshape(-1), stable=True)
        return PairOrder(order_P=order_P, tokens_P=order_P // topk_ids_TK.shape[1],
                         scores_S=torch.index_select(topk_scores_TK.reshape(-1), 0, order_P))


@dataclass(frozen=True, kw_only=True)
class PairRouting:
    """The pairs of one token partition, sorted by global expert.

    Attributes:
        order_P: flattened pair positions sorted by expert (stable) ``(P,)``.
        tokens_P: the token of each sorted pair, ``order_P // K`` ``(P,)``.
        starts_host: prefix sums of pairs per expert on the host, ``E + 1`` ints (chunks are planned from them).
        top_k: K.
        experts_per_rank: E_l.
    """

    order_P: Tensor
    tokens_P: Tensor
    starts_host: list[int]
    top_k: int
    experts_per_rank: int

    @staticmethod
    def counts(topk_ids_TK: Tensor, num_experts: int) -> Tensor:
        """Pairs per global expert ``(E,)`` int64 (``scatter_add_``: ``bincount`` has a data-dependent size)."""
        ids_P = topk_ids_TK.reshape(-1).to(torch.int64)
        return torch.zeros(num_experts, dtype=torch.int64, device=ids_P.device).scatter_add_(
            0, ids_P, torch.ones_like(ids_P)
        )

    @staticmethod
    def build(topk_ids_TK: Tensor, counts_host: list[int], experts_per_rank: int, order: PairOrder | None = None
              ) -> PairRouting:
        """Sort the pairs of ``topk_ids_TK`` given its pairs per expert (read on the host once per step);
        ``order``: sorted already (``PairOrder.of`` the same ids)."""
        if order is None:
            order_P = torch.argsort(topk_ids_TK.reshape(-1), stable=True)
            tokens_P = order_P // topk_ids_TK.shape[1]
        else:
            order_P, tokens_P = order.order_P, order.tokens_P
        starts_host = [0]
        for c in counts_host:
            starts_host.append(starts_host[-1] + c)
        return PairRouting(
            order_P=order_P,
            tokens_P=tokens_P,
            starts_host=starts_host,
            top_k=topk_ids_TK.shape[1],
            experts_per_rank=experts_per_rank,
        )

    def owner_range(self, owner: int) -> tuple[int, int]:
        """Sorted-pair range ``[start, end)`` of the experts of rank ``owner``."""
        e_l = self.experts_per_rank
        return self.starts_host[owner * e_l], self.starts_host[(owner + 1) * e_l]

    def rows_per_expert(self, owner: int) -> list[int]:
        """Rows of each of ``owner``'s local experts (host ints, ``E_l``)."""
        e_l, starts = self.experts_per_rank, self.starts_host
        return [starts[e + 1] - starts[e] for e in range(owner * e_l, (owner + 1) * e_l)]


ChunkBounds = tuple[int, int, int, int, tuple[int, ...]]


def split_experts(rows_L: list[int], base: int, max_rows: int | None) -> list[ChunkBounds]:
    """Expert-aligned chunks of one hop's sorted range ``[base, base + sum(rows_L))``.

    Whole experts are packed in order while they fit ``max_rows``; an expert with more rows than that is cut
    into ``ceil(rows / max_rows)`` near-equal pieces. Experts with no rows join a neighbour or are left out;
    a hop with no rows has no chunks. ``max_rows=None`` is one chunk of every expert.

    Returns:
        ``(start, end, lo, hi, rows)`` per chunk: sorted pairs ``[start, end)`` on local experts ``[lo, hi)``,
        ``rows`` per expert of ``[lo, hi)``.

    Example (``max_rows=4``): ``rows_L=[3, 0, 2, 9]`` -> ``[0, 3)`` on experts ``[0, 2)``, ``[3, 5)`` on
    ``[2, 3)``, then expert 3 in pieces of 3 rows: ``[5, 8)``, ``[8, 11)``, ``[11, 14)``.
    """
    total = sum(rows_L)
    if total == 0:
        return []
    if not max_rows or total <= max_rows:
        return [(base, base + total, 0, len(rows_L), tuple(rows_L))]
    chunks: list[ChunkBounds] = []
    lo, start, pos = 0, base, base  # the open chunk: experts [lo, e), sorted pairs [start, pos)

    def close(hi: int) -> None:
        if pos > start:
            chunks.append((start, pos, lo, hi, tuple(rows_L[lo:hi])))

    for e, rows in enumerate(rows_L):
        if rows > max_rows:
            close(e)
            pieces = -(-rows // max_rows)
            cuts = [pos + rows * i // pieces for i in range(pieces + 1)]
            chunks += [(a, b, e, e + 1, (b - a,)) for a, b in zip(cuts, cuts[1:])]
            pos += rows
            lo, start = e + 1, pos
        elif pos - start + rows > max_rows:
            close(e)
            lo, start = e, pos
            pos += rows
        else:
            pos += rows
    close(len(rows_L))
    return chunks


def split_owners(routing: PairRouting, owners: Sequence[int], max_rows: int | None) -> list[ChunkBounds]:
    """Expert-aligned chunks of a hop that holds several owners' weights stacked in ``owners``' order (slot ``s``:
    experts ``[s E_l, (s + 1) E_l)`` of the stack), for a grouped forward hop (``hop_compute``).

    Each run of consecutive owners is one sorted range, cut by ``split_experts``; a group that wraps around the
    ring (owner ``N - 1`` then ``0``) is two ranges. ``lo``/``hi`` index the stack.
    """
    e_l = routing.experts_per_rank
    bounds: list[ChunkBounds] = []
    s = 0
    while s < len(owners):
        t = s + 1
        while t < len(owners) and owners[t] == owners[t - 1] + 1:
            t += 1
        rows_L = [r for owner in owners[s:t] for r in routing.rows_per_expert(owner)]
        for start, end, lo, hi, rows in split_experts(rows_L, routing.starts_host[owners[s] * e_l], max_rows):
            bounds.append((start, end, lo + s * e_l, hi + s * e_l, rows))
        s = t
    return bounds


@dataclass(frozen=True, kw_only=True)
class Chunk:
    """One chunk of a hop: sorted pairs ``[start, end)`` on the owner's local experts ``[lo, hi)``.

    Attributes:
        rows: rows per expert of ``[lo, hi)`` (host ints; ``G = hi - lo``).
        offsets_G: their int32 prefix sums on the device, ``torch._grouped_mm``'s ``offs`` ``(G,)``.
        counts_L: rows per local expert, zero outside ``[lo, hi)``, int64 on the device ``(E_l,)``.
        whole: the chunk spans every local expert (its weight gradients are whole partitions).
    """

    start: int
    end: int
    lo: int
    hi: int
    rows: tuple[int, ...]
    offsets_G: Tensor
    counts_L: Tensor
    whole: bool


# Offsets start at multiples of 4 int32 (16 bytes) in the step's table: aligned like a fresh allocation.
_OFFSET_ALIGN = 4


def plan_chunks(
    bounds: list[list[ChunkBounds]], experts: int | Sequence[int], device: torch.device
) -> list[list[Chunk]]:
    """Device tables for every chunk of a step (one list per hop), in one host-to-device copy.

    ``experts``: the experts a hop's weights hold (``E_l``; a grouped forward hop holds several owners'), one
    for every hop or one per hop: the length of a chunk's ``counts_L``, and what a ``whole`` chunk spans.
    """
    experts_H = [experts] * len(bounds) if isinstance(experts, int) else list(experts)
    flat: list[int] = []
    placed = []
    for hop_bounds, experts_per_rank in zip(bounds, experts_H, strict=True):
        for start, end, lo, hi, rows in hop_bounds:
            at_offsets = len(flat)
            total = 0
            for r in rows:
                total += r
                flat.append(total)
            flat += [0] * (-len(flat) % _OFFSET_ALIGN)
            at_counts = len(flat)
            flat += [0] * lo + list(rows) + [0] * (experts_per_rank - hi)
            flat += [0] * (-len(flat) % _OFFSET_ALIGN)
            placed.append((at_offsets, at_counts))
    if not placed:
        return [[] for _ in bounds]
    table = torch.tensor(flat, dtype=torch.int64, pin_memory=device.type == "cuda").to(device, non_blocking=True)
    table32 = table.to(torch.int32)
    plans, i = [], 0
    for hop_bounds, experts_per_rank in zip(bounds, experts_H, strict=True):
        chunks = []
        for start, end, lo, hi, rows in hop_bounds:
            at_offsets, at_counts = placed[i]
            i += 1
            chunks.append(Chunk(
                start=start, end=end, lo=lo, hi=hi, rows=rows,
                offsets_G=table32[at_offsets : at_offsets + hi - lo],
                counts_L=table[at_counts : at_counts + experts_per_rank],
                whole=lo == 0 and hi == experts_per_rank,
            ))
        plans.append(chunks)
    return plans


def padded_positions(
    first: Sequence[int], real: Sequence[int], rows: Sequence[int], pairs: int, device: torch.device
) -> Tensor:
    """The sorted-pair position of every row of segments padded to ``rows``: segment ``s`` holds pairs
    ``[first[s], first[s] + real[s])``, then ``rows[s] - real[s]`` padding rows, which read position ``pairs``
    (one past the last pair: callers append a padding entry there). ``(sum(rows),)`` int64 on ``device``, built
    in a few ops from one upload, no sync."""
    total = sum(rows)
    segs = torch.tensor([list(first), list(real), list(rows)], dtype=torch.int64,
                        pin_memory=device.type == "cuda").to(device, non_blocking=True)
    first_S, real_S, rows_S = segs.unbind(0)
    seg_Q = torch.repeat_interleave(torch.arange(len(rows), device=device), rows_S, output_size=total)
    local_Q = torch.arange(total, device=device) - (torch.cumsum(rows_S, 0) - rows_S)[seg_Q]
    return torch.where(local_Q < real_S[seg_Q], first_S[seg_Q] + local_Q, pairs)


def per_hop_bytes(
    routing: Routing, *, tokens: int, hidden: int, top_k: int, experts_per_rank: int, expert_bytes: int,
    elem_bytes: int, expert_grad_bytes: int | None = None, sum_elem_bytes: int | None = None,
) -> dict[str, int]:
    """Per-hop transfer volume of one routing mode, forward and backward, as this ring sends it.

    Expert routing moves ``E_l`` experts' weights, and in backward their weight gradients beside them
    (paper Table 2). Token routing moves the tokens with their routing metadata (ids int64 + scores: M per
    token), and beside them the output accumulator one hop behind (forward); in backward the tokens, output
    gradients and metadata, with the ``dx``/``d_scores`` accumulators one hop behind. The sums travel in
    their own dtype (``fp32_accumulation``): ``expert_grad_bytes`` per expert's gradient (None:
    ``expert_bytes``), ``sum_elem_bytes`` per element of ``y``/``dx`` (None: ``elem_bytes``).
    """
    if routing == "expert":
        fwd = experts_per_rank * expert_bytes
        return {"forward": fwd, "backward": fwd + experts_per_rank * (expert_grad_bytes or expert_bytes)}
    metadata = top_k * (8 + elem_bytes)
    row, sum_row = hidden * elem_bytes, hidden * (sum_elem_bytes or elem_bytes)
    return {
        "forward": tokens * (row + metadata) + tokens * sum_row,
        "backward": tokens * (2 * row + metadata) + tokens * (sum_row + top_k * elem_bytes),
    }


def summed_bytes(elem_bytes: int, fp32_accumulation: bool) -> int:
    """Bytes per element of a sum across hops of elements of ``elem_bytes`` (the ``fp32_accumulation`` option)."""
    return max(elem_bytes, 4) if fp32_accumulation else elem_bytes


def choose_routing(**volume_args: int) -> Routing:
    """``"auto"``: the mode with less forward+backward traffic per hop (ties go to expert routing)."""
    expert = sum(per_hop_bytes("expert", **volume_args).values())
    token = sum(per_hop_bytes("token", **volume_args).values())
    return "token" if token < expert else "expert"

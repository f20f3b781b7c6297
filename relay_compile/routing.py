"""Routing bookkeeping of one step: pairs sorted once, every hop's segment read from one set of offsets.

A *pair* is one (token, k) slot of ``topk_ids``; ``P = T*K`` pairs, flattened position ``p = t*K + k``.
Sorting the pairs by global expert once per step groups them by owner rank (expert ``e`` lives on rank
``e // E_l``), so the pairs a hop needs are one contiguous range of the sorted order:

    topk_ids = [[3, 0], [1, 3]]   (T=2, K=2, E=4, N=2, E_l=2)
    order_P  = [1, 2, 0, 3]       pairs (t0,k1)->e0, (t1,k0)->e1, (t0,k0)->e3, (t1,k1)->e3
    owner 0: order_P[0:2]         owner 1: order_P[2:4]

The host needs the counts once per step (to size tensors); nothing in the hop loop syncs.

Also here: ``choose_routing``, the paper's Table 2 rule for ``routing="auto"``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Routing = Literal["expert", "token"]
ROUTINGS: tuple[str, ...] = ("auto", "expert", "token")


@dataclass(frozen=True, kw_only=True)
class PairRouting:
    """The pairs of one token partition, sorted by global expert.

    Attributes:
        order_P: flattened pair positions sorted by expert (stable) ``(P,)``.
        starts_E1: device prefix sums of pairs per expert ``(E + 1,)``.
        starts_host: the same on the host, ``E + 1`` ints.
        top_k: K.
        experts_per_rank: E_l.
    """

    order_P: Tensor
    starts_E1: Tensor
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
    def build(topk_ids_TK: Tensor, counts_E: Tensor, counts_host: list[int], experts_per_rank: int) -> PairRouting:
        """Sort the pairs of ``topk_ids_TK`` given its counts (device and host copies)."""
        order_P = torch.argsort(topk_ids_TK.reshape(-1), stable=True)
        starts_E1 = torch.nn.functional.pad(torch.cumsum(counts_E, 0), (1, 0))
        starts_host = [0]
        for c in counts_host:
            starts_host.append(starts_host[-1] + c)
        return PairRouting(
            order_P=order_P,
            starts_E1=starts_E1,
            starts_host=starts_host,
            top_k=topk_ids_TK.shape[1],
            experts_per_rank=experts_per_rank,
        )

    def owner_range(self, owner: int) -> tuple[int, int]:
        """Sorted-pair range ``[start, end)`` of the experts of rank ``owner``."""
        e_l = self.experts_per_rank
        return self.starts_host[owner * e_l], self.starts_host[(owner + 1) * e_l]

    def chunks(self, owner: int, max_rows: int | None) -> Iterator[tuple[int, int]]:
        """Bounded pieces of ``owner``'s range (the whole range when ``max_rows`` is None); none if empty."""
        start, end = self.owner_range(owner)
        step = max(1, max_rows) if max_rows else max(1, end - start)
        for c0 in range(start, end, step):
            yield c0, min(end, c0 + step)

    def chunk_counts(self, owner: int, c0: int, c1: int) -> Tensor:
        """Rows per local expert of ``owner`` inside the sorted range ``[c0, c1)`` ``(E_l,)``, on device."""
        e_l = self.experts_per_rank
        begin_L = self.starts_E1[owner * e_l : (owner + 1) * e_l]
        end_L = self.starts_E1[owner * e_l + 1 : (owner + 1) * e_l + 1]
        return end_L.clamp(c0, c1) - begin_L.clamp(c0, c1)


def per_hop_bytes(
    routing: Routing, *, tokens: int, hidden: int, top_k: int, experts_per_rank: int, expert_bytes: int,
    elem_bytes: int,
) -> dict[str, int]:
    """Per-hop transfer volume of one routing mode, forward and backward, as this ring sends it.

    Expert routing moves ``E_l`` experts' weights, and in backward their weight gradients beside them
    (paper Table 2). Token routing moves the tokens with their routing metadata (ids int64 + scores: M per
    token), and beside them the output accumulator one hop behind (forward); in backward the tokens, output
    gradients and metadata, with the ``dx``/``d_scores`` accumulators one hop behind.
    """
    if routing == "expert":
        fwd = experts_per_rank * expert_bytes
        return {"forward": fwd, "backward": 2 * fwd}
    metadata = top_k * (8 + elem_bytes)
    row = hidden * elem_bytes
    return {
        "forward": tokens * (row + metadata) + tokens * row,
        "backward": tokens * (2 * row + metadata) + tokens * (row + top_k * elem_bytes),
    }


def choose_routing(**volume_args: int) -> Routing:
    """``"auto"``: the mode with less forward+backward traffic per hop (ties go to expert routing)."""
    expert = sum(per_hop_bytes("expert", **volume_args).values())
    token = sum(per_hop_bytes("token", **volume_args).values())
    return "token" if token < expert else "expert"

"""Ring transport: one hop's asynchronous P2P transfer, sent to the next rank and received from the previous.

Every transfer of a ring program is a ``RingTransfer``: ``start`` posts the sends and receives of a payload
(several tensors in one ``batch_isend_irecv``: weights and trailing gradients travel merged), ``wait`` blocks
until both sides complete and returns the receive buffers. All ranks run the same program, so they post the
same transfers in the same order; tags keep concurrent transfers to the same peer apart (gloo matches by tag,
NCCL by order).

Timeouts: a transfer waits as long as the process group's timeout (``init_process_group(timeout=...)``);
a peer that dies mid-ring makes the others fail after that timeout, as with any collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch import Tensor

# Tags of one transfer are ``index * TAGS_PER_TRANSFER + position``: room for every tensor of a payload.
TAGS_PER_TRANSFER = 64


@dataclass(frozen=True, kw_only=True)
class RingGroup:
    """The EP group as a ring: this rank, its size, and the global ranks of its two neighbours."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    next_global: int
    prev_global: int

    @staticmethod
    def resolve(group_name: str) -> RingGroup:
        """The ring of a process group by name; ``""`` is a ring of one (no communication)."""
        if not group_name:
            return RingGroup(group=None, rank=0, size=1, next_global=0, prev_global=0)
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(group_name)
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        return RingGroup(
            group=group,
            rank=rank,
            size=size,
            next_global=dist.get_global_rank(group, (rank + 1) % size),
            prev_global=dist.get_global_rank(group, (rank - 1) % size),
        )


@dataclass(kw_only=True)
class RingTransfer:
    """One posted transfer: the send tensors stay referenced until ``wait`` so they are not freed early."""

    sent: list[Tensor]
    received: list[Tensor]
    works: list[dist.Work] = field(default_factory=list)

    def wait(self) -> tuple[Tensor, ...]:
        for work in self.works:
            work.wait()
        self.sent = []
        return tuple(self.received)


def start_transfer(ring: RingGroup, index: int, payload: list[Tensor], receive: list[Tensor]) -> RingTransfer:
    """Post ``payload`` to the next rank and ``receive`` (preallocated, contiguous) from the previous."""
    assert len(payload) == len(receive) <= TAGS_PER_TRANSFER, "ring transport: payload and receive disagree"
    sent = [t.contiguous() for t in payload]
    if ring.size == 1:
        return RingTransfer(sent=[], received=sent)
    ops = []
    for pos, (send_t, recv_t) in enumerate(zip(sent, receive, strict=True)):
        tag = index * TAGS_PER_TRANSFER + pos
        ops.append(dist.P2POp(dist.isend, send_t, ring.next_global, ring.group, tag))
        ops.append(dist.P2POp(dist.irecv, recv_t, ring.prev_global, ring.group, tag))
    return RingTransfer(sent=sent, received=receive, works=dist.batch_isend_irecv(ops))


def all_gather_rows(ring: RingGroup, row_R: Tensor) -> Tensor:
    """Every rank's ``row_R`` stacked ``(N, R)``: the step's one small collective of token routing."""
    if ring.size == 1:
        return row_R[None]
    # Flat output: gloo's all-gather rejects a 2-D output tensor.
    out = row_R.new_empty(ring.size * row_R.numel())
    # all_gather_single is 2.13's name; 2.11 (our GPU machines) only has all_gather_into_tensor.
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    gather(out, row_R.contiguous(), group=ring.group)
    return out.view(ring.size, -1)


def all_reduce_max(ring: RingGroup, t: Tensor) -> Tensor:
    """Elementwise max over the group (error flags: one rank's bad input stops every rank)."""
    if ring.size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ring.group)
    return t

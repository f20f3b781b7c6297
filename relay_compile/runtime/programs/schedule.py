"""The static shape of a ring program: which schedule runs, and where each program node sits in it.

A ``RingSchedule`` holds sizes only (hops, circulating and trailing tensors), identical on every rank: it is
what makes every rank build, shape and run the same program. ``schedule_for`` derives it from the direction,
the routing, the EP size and how many weight tensors circulate (the expert function's packed layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Direction = Literal["forward", "backward"]
Role = Literal["start", "wait", "compute", "recompute", "accumulate", "stack", "finish"]
RingName = Literal["forward", "replay", "grad"]


@dataclass(frozen=True, kw_only=True)
class RingNode:
    """Where a program node sits in the schedule (``node.meta["ring"]``)."""

    ring: RingName
    hop: int
    role: Role


@dataclass(frozen=True, kw_only=True)
class RingSchedule:
    """The static shape of a program: sizes only, identical on every rank.

    ``num_circulating``: tensors that move each hop. ``num_trailing``: accumulators one hop behind.
    ``num_replayed``: backward only, the circulating tensors the replay ring needs (a prefix).
    ``owners_per_hop``: ``g`` partitions per hop, stacked (``build``: the grouped rings): expert routing ``g``
    owners' weights (the rules ``ring_options.owners_per_hop`` and ``backward_owners_per_hop`` decide it, or the
    cost model a larger stack, ``ops._owners``), token routing ``g`` sources' tokens
    (``ring_options.token_partitions_per_hop``, ``token_backward_partitions_per_hop``); ``num_hops`` stays the
    ring's size ``N``.
    """

    direction: Direction
    routing: str
    num_hops: int
    num_circulating: int
    num_trailing: int
    num_replayed: int = 0
    owners_per_hop: int = 1

    def __post_init__(self) -> None:
        g = self.owners_per_hop
        if g > 1 and not (self.num_hops % g == 0 and 2 * g <= self.num_hops):
            raise ValueError(f"RingSchedule: {g} partitions per hop need a ring of a multiple of {g} ranks, at least "
                             f"{2 * g} (got {self.direction} {self.routing} on {self.num_hops})")


def schedule_for(
    direction: Direction, routing: str, num_hops: int, num_weights: int, owners_per_hop: int = 1,
    num_grads: int | None = None,
) -> RingSchedule:
    """The schedule of one (direction, routing) pair; ``num_weights``: circulating weight tensors (packed);
    ``num_grads``: their gradients (default as many; fewer where FP8 weights circulate with their scales).

    Expert routing circulates the weights (backward: their gradients trail). Token routing circulates
    ``(x, ids, scores)`` (backward: ``+ dy``); ``y`` (backward: ``dx, d_scores``) trails. Either may hold
    ``owners_per_hop`` partitions per hop.
    """
    if routing == "expert":
        return RingSchedule(
            direction=direction, routing=routing, num_hops=num_hops, num_circulating=num_weights,
            num_trailing=(num_weights if num_grads is None else num_grads) if direction == "backward" else 0, num_replayed=num_weights,
            owners_per_hop=owners_per_hop,
        )
    return RingSchedule(
        direction=direction, routing=routing, num_hops=num_hops,
        num_circulating=3 if direction == "forward" else 4,
        num_trailing=1 if direction == "forward" else 2, num_replayed=3, owners_per_hop=owners_per_hop,
    )

"""The static shape of a ring program: which schedule runs, and where each program node sits in it.

A ``RingSchedule`` holds sizes only (hops, circulating and trailing tensors), identical on every rank: it is
what makes every rank build, shape and run the same program. ``schedule_for`` derives it from the direction,
the routing, the EP size and how many weight tensors circulate (the expert function's packed layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Direction = Literal["forward", "backward"]
Role = Literal["start", "wait", "compute", "recompute", "accumulate", "finish"]
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
    """

    direction: Direction
    routing: str
    num_hops: int
    num_circulating: int
    num_trailing: int
    num_replayed: int = 0


def schedule_for(direction: Direction, routing: str, num_hops: int, num_weights: int) -> RingSchedule:
    """The schedule of one (direction, routing) pair; ``num_weights``: circulating weight tensors (packed).

    Expert routing circulates the weights (backward: their gradients trail). Token routing circulates
    ``(x, ids, scores)`` (backward: ``+ dy``); ``y`` (backward: ``dx, d_scores``) trails.
    """
    if routing == "expert":
        return RingSchedule(
            direction=direction, routing=routing, num_hops=num_hops, num_circulating=num_weights,
            num_trailing=num_weights if direction == "backward" else 0, num_replayed=num_weights,
        )
    return RingSchedule(
        direction=direction, routing=routing, num_hops=num_hops,
        num_circulating=3 if direction == "forward" else 4,
        num_trailing=1 if direction == "forward" else 2, num_replayed=3,
    )

"""pipeline: the programs of a ring spec, built once and shaped by the program passes.

    schedule_for(direction, routing, N, circulating weights, owners per hop)   # schedule.py: sizes only
      -> build_program                                       # build.py: the naive program
      -> remat_pass (backward, option ``remat``)             # remat.py
      -> sum_in_place_pass (trailing sums; backward: after remat)  # sum_in_place.py
      -> overlap_pass (option ``overlap``)                   # overlap.py

``program_for`` is the one place that decides which program a spec runs: the custom ops call it at run time
and the backend's dumps call it for the same spec, so what is dumped is what runs.
"""

from __future__ import annotations

import functools

import torch.fx as fx

from relay_compile.routing import Routing
from relay_compile.runtime.programs.build import build_program
from relay_compile.runtime.programs.overlap import overlap_pass
from relay_compile.runtime.programs.remat import remat_pass
from relay_compile.runtime.programs.schedule import Direction, RingSchedule, schedule_for
from relay_compile.runtime.programs.sum_in_place import sum_in_place_pass
from relay_compile.runtime.ring_options import (
    HopShape,
    backward_owners_per_hop,
    owners_per_hop,
    token_backward_partitions_per_hop,
    token_partitions_per_hop,
)
from relay_compile.runtime.specs import RingSpec


@functools.cache
def shaped_program(sched: RingSchedule, overlap: bool, remat: bool) -> fx.GraphModule:
    """The program of a schedule after the passes: naive build, then ``remat`` (backward) and ``overlap``.

    ``gm.meta["schedule"]`` keeps ``sched``: what runs the program reads its shape there, never derives it again.
    """
    gm = build_program(sched)
    if remat and sched.direction == "backward":
        gm = remat_pass(gm)
    if sched.num_trailing and (remat or sched.direction == "forward"):  # a replayed backward keeps its partials
        gm = sum_in_place_pass(gm)
    if overlap:
        gm = overlap_pass(gm)
    gm.meta["schedule"] = sched
    return gm


def hop_owners(direction: Direction, routing: Routing, grouped_experts: bool, shape: HopShape) -> int:
    """The rules' partitions per hop. Expert routing (``ring_options.owners_per_hop``,
    ``backward_owners_per_hop``): more than one owner only for an expert function with grouped entry points (a
    stack of owners' weights is one operand of its grouped GEMMs; any other F takes one partition per call); a
    call holds them unless the cost model chose a larger stack (``ops._owners``). Token routing
    (``ring_options.token_partitions_per_hop``, ``token_backward_partitions_per_hop``): any F (a stack of sources'
    tokens is one visiting partition)."""
    if routing == "token":
        return (token_partitions_per_hop(shape) if direction == "forward"
                else token_backward_partitions_per_hop(shape))
    if not grouped_experts:
        return 1
    return owners_per_hop(shape) if direction == "forward" else backward_owners_per_hop(shape)


def program_for(
    spec: RingSpec, direction: Direction, routing: Routing, group_size: int, num_weights: int, owners: int = 1
) -> fx.GraphModule:
    """The program ``spec`` runs in ``direction`` with ``routing`` on ``group_size`` ranks, ``owners`` per hop
    (``ops._owners``: the cost model's choice, else the rules', ``hop_owners``).

    ``num_weights``: the weight tensors the op receives (the expert function may pack them into fewer).
    """
    sched = schedule_for(direction, routing, group_size, spec.circulating_weights(num_weights), owners,
                         spec.circulating_grads(num_weights))
    return shaped_program(sched, spec.options.overlap, spec.options.remat)

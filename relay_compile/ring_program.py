"""Ring programs: one MoE block's ring schedule as an FX graph of unrolled hops.

A program is built once per (direction, routing, EP size) in its *naive* form, then shaped by the passes in
``relay_compile.passes``: ``remat`` (backward: recompute per hop instead of replaying the whole block first)
and ``overlap`` (post each hop's transfer before its compute, wait as late as possible). It runs eagerly
inside the ``relaymoe`` custom ops, on a ``RingStep`` that binds it to one call's tensors.

Every schedule has the same skeleton: a *circulating* payload moves one rank forward per hop (expert
routing: weights; token routing: tokens with their routing), and optionally *trailing* accumulators follow
it one hop behind (expert backward: weight gradients; token routing: the outputs or input gradients):

    hop h (naive):  part_h  = hop_*(step, h, *circ_h)
                    xfer_h  = ring_start(step, i, h, n, *circ_h [if h < N-1], *trail_{h-1} [if h >= 1])
                    circ_{h+1}, trail_in_h = ring_wait(xfer_h)
                    trail_h = accumulate(*trail_in_h, *part_h)           [trail_0 = part_0]
    after hop N-1:  ring_start/ring_wait of trail_{N-1} only: accumulators return to their owners
    output:         finish(step, *trail)

The naive backward is what activation checkpointing of the whole block would do: a *replay* ring first
recomputes every hop's activations (``hop_recompute``, all kept alive), then the gradient ring consumes them
(``hop_vjp``). ``remat`` turns it into one ring whose hops recompute, consume and release.

Node metadata ``node.meta["ring"]`` is a ``RingNode``: which ring and hop a node belongs to and its role.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx as fx
from torch import Tensor

from relay_compile.runtime.hop_compute import HopActivations, RingStep
from relay_compile.runtime.transport import RingTransfer, start_transfer

Direction = Literal["forward", "backward"]
Role = Literal["start", "wait", "compute", "recompute", "accumulate", "finish"]
RingName = Literal["forward", "replay", "grad"]


@dataclass(frozen=True, kw_only=True)
class RingNode:
    """Where a program node sits in the schedule."""

    ring: RingName
    hop: int
    role: Role


# --- The instruction set: what program nodes call. -------------------------------------------------


def ring_start(step: RingStep, index: int, hop: int, num_circulating: int, *payload: Tensor) -> RingTransfer:
    """Post transfer ``index`` (tags), sent at ``hop`` of its ring: ``payload[:num_circulating]`` moves on,
    the rest are trailing accumulators."""
    receive = step.receive_buffers(hop, num_circulating, payload)
    return start_transfer(step.cfg.ring, index, list(payload), receive)


def ring_wait(transfer: RingTransfer) -> tuple[Tensor, ...]:
    """Block until a transfer completes; its receive buffers."""
    return transfer.wait()


def hop_forward(step: RingStep, hop: int, *circulating: Tensor) -> tuple[Tensor, ...]:
    """Forward hop: the pairs that meet here; returns trailing partials (token routing) or ``()``."""
    return step.forward_hop(hop, *circulating)


def hop_backward(step: RingStep, hop: int, *circulating: Tensor) -> tuple[Tensor, ...]:
    """Backward hop with hop-scoped recomputation (chunk by chunk); returns trailing partials."""
    return step.backward_hop(hop, *circulating)


def hop_recompute(step: RingStep, hop: int, *circulating: Tensor) -> HopActivations:
    """Recompute a whole hop's expert activations and keep them (the naive, checkpoint-style backward)."""
    return step.recompute_hop(hop, *circulating)


def hop_vjp(step: RingStep, hop: int, acts: HopActivations, *circulating: Tensor) -> tuple[Tensor, ...]:
    """Gradient hop consuming ``hop_recompute``'s activations."""
    return step.vjp_hop(hop, acts, *circulating)


def accumulate(num: int, *incoming_and_partial: Tensor) -> tuple[Tensor, ...]:
    """``incoming[i] += partial[i]`` in place: the trailing accumulators gain this hop's contribution."""
    incoming, partial = incoming_and_partial[:num], incoming_and_partial[num:]
    for acc, part in zip(incoming, partial, strict=True):
        acc.add_(part)
    return incoming


def finish(step: RingStep, *trailing: Tensor) -> tuple[Tensor, ...]:
    """The op's results: local accumulators, and the trailing accumulators returned to this rank."""
    return step.finish(*trailing)


# Hop nodes mutate the step's accumulators and transfers move data: dead-code elimination must keep them.
for _fn in (ring_start, ring_wait, hop_forward, hop_backward, hop_recompute, hop_vjp, accumulate, finish):
    fx.node.has_side_effect(_fn)


# --- Building the naive programs. -----------------------------------------------------------------


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


class _Builder:
    """Emits one ring's hops into a graph, tagging every node with its ``RingNode``."""

    def __init__(self, graph: fx.Graph, step: fx.Node, sched: RingSchedule) -> None:
        self.graph, self.step, self.sched = graph, step, sched

    def call(self, fn, args: tuple, meta: RingNode, arity: int | None = None) -> fx.Node | list[fx.Node]:
        node = self.graph.call_function(fn, args)
        node.meta["ring"] = meta
        if arity is None:
            return node
        items = []
        for i in range(arity):
            item = self.graph.call_function(operator.getitem, (node, i))
            item.meta["ring"] = meta
            items.append(item)
        return items

    def transfer(self, ring: RingName, hop: int, index: int, circ: list, trail: list) -> list[fx.Node]:
        start = self.call(ring_start, (self.step, index, hop, len(circ), *circ, *trail), RingNode(
            ring=ring, hop=hop, role="start"))
        return self.call(ring_wait, (start,), RingNode(ring=ring, hop=hop, role="wait"), len(circ) + len(trail))

    def ring(self, name: RingName, circ0: list[fx.Node], first_index: int, compute) -> list[fx.Node]:
        """Emit N hops; ``compute(hop, circ) -> partial nodes``; returns the final trailing accumulators."""
        n, n_trail = self.sched.num_hops, self.sched.num_trailing if name != "replay" else 0
        circ, trail = circ0, []
        for hop in range(n):
            partial = compute(hop, circ)
            send_circ = circ if hop < n - 1 else []
            send_trail = trail if hop >= 1 else []
            received = (
                self.transfer(name, hop, first_index + hop, send_circ, send_trail) if send_circ or send_trail
                else []
            )
            circ, incoming = received[: len(send_circ)], received[len(send_circ):]
            if n_trail == 0:
                continue
            trail = (
                self.call(accumulate, (n_trail, *incoming, *partial),
                          RingNode(ring=name, hop=hop, role="accumulate"), n_trail)
                if hop >= 1 else partial
            )
        if n_trail and n > 1:
            trail = self.transfer(name, n, first_index + n, [], trail)  # the return to the owners
        return trail


def build_program(sched: RingSchedule) -> fx.GraphModule:
    """The naive program of a schedule (see the module docstring)."""
    graph = fx.Graph()
    step = graph.placeholder("step")
    circ0 = [graph.placeholder(f"circ{i}") for i in range(sched.num_circulating)]
    b = _Builder(graph, step, sched)
    n_trail = sched.num_trailing
    if sched.direction == "forward":
        def fwd(hop: int, circ: list[fx.Node]) -> list[fx.Node]:
            return b.call(hop_forward, (step, hop, *circ), RingNode(ring="forward", hop=hop, role="compute"),
                          n_trail)
        trail = b.ring("forward", circ0, 0, fwd)
    else:
        acts: dict[int, fx.Node] = {}

        def replay(hop: int, circ: list[fx.Node]) -> list[fx.Node]:
            acts[hop] = b.call(hop_recompute, (step, hop, *circ[: sched.num_replayed]),
                               RingNode(ring="replay", hop=hop, role="recompute"))
            return []

        def grad(hop: int, circ: list[fx.Node]) -> list[fx.Node]:
            return b.call(hop_vjp, (step, hop, acts[hop], *circ), RingNode(ring="grad", hop=hop, role="compute"),
                          n_trail)

        b.ring("replay", circ0[: sched.num_replayed], sched.num_hops + 1, replay)
        trail = b.ring("grad", circ0, 0, grad)
    out = graph.call_function(finish, (step, *trail))
    out.meta["ring"] = RingNode(ring="grad" if sched.direction == "backward" else "forward",
                                hop=sched.num_hops, role="finish")
    graph.output(out)
    graph.lint()
    return fx.GraphModule(torch.nn.Module(), graph, class_name=f"RingProgram_{sched.direction}_{sched.routing}")


def schedule_for(direction: Direction, routing: str, num_hops: int, num_weights: int) -> RingSchedule:
    """The schedule of one (direction, routing) pair; see ``RingStep`` for what circulates."""
    if routing == "expert":
        return RingSchedule(
            direction=direction, routing=routing, num_hops=num_hops, num_circulating=num_weights,
            num_trailing=num_weights if direction == "backward" else 0, num_replayed=num_weights,
        )
    # Token routing: (x, ids, scores) [+ dy]; trailing y, or (dx, d_scores).
    return RingSchedule(
        direction=direction, routing=routing, num_hops=num_hops,
        num_circulating=3 if direction == "forward" else 4,
        num_trailing=1 if direction == "forward" else 2, num_replayed=3,
    )


def run_program(program: fx.GraphModule, step: RingStep, circulating: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """Execute a program on a bound step (eagerly: it already runs inside a custom op)."""
    return program(step, *circulating)

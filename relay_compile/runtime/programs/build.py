"""build: one MoE block's ring schedule as an FX graph of unrolled hops (the naive program).

``build_program`` emits a schedule's *naive* form; the passes of this package shape it: ``remat`` (backward:
recompute per hop instead of replaying the whole block first) and ``overlap`` (post each hop's transfer before
its compute, wait as late as possible); ``pipeline.shaped_program`` runs them. A program runs eagerly inside
the ``relaymoe`` custom ops, on a ``RingStep`` that binds it to one call's tensors.

Every schedule has the same skeleton: a *circulating* payload moves one rank forward per hop (expert
routing: weights; token routing: tokens with their routing), and optionally *trailing* accumulators follow
it one hop behind (expert backward: weight gradients; token routing: the outputs or input gradients):

    hop h (naive):  part_h  = hop_*(step, h, *circ_h)
                    xfer_h  = ring_start(step, i, h, n, *circ_h [if h < N-1], *trail_{h-1} [if h >= 1])
                    circ_{h+1}, trail_in_h = ring_wait(xfer_h)
                    trail_h = accumulate(*trail_in_h, *part_h)           [trail_0 = part_0]
    after hop N-1:  ring_start/ring_wait of trail_{N-1} only: accumulators return to their owners
    output:         finish(step, *trail)

Expert routing's forward with ``g = sched.owners_per_hop > 1`` (small hops: ``ring_options.owners_per_hop``; or
the cost model's larger stack where the rules' ring would lose, ``ops._owners``)
holds ``g`` owners' weights per hop, stacked in one tensor per weight, and moves them ``g`` ranks per hop:

    hop 0:          ring_start(..., *circ_0, stride=s, slot=g-1-s)  s = 1..g-1: own weights to rank r+s, owner
                                                                  r-s into its slot of the first stack
                    stack_0 = stack_owners(step, *slots)          + own weights: owners r-g+1 .. r
    hop j:          ring_start(..., *stack_{j-1}, stride=g)       stack j-1 on, stack j in   [j >= 1]
                    hop_forward_group(step, j, *stack_j)          owners r-gj-g+1 .. r-gj

``N/g`` hops compute instead of ``N`` (EP=64, g=8: 8), one grouped GEMM call over ``g`` owners' experts each;
every owner is still met exactly once (the stack of rank ``r - g`` at group ``j - 1`` is this rank's at group
``j``). The first stack is gathered in one exchange before any compute, its ``g - 1`` transfers in flight
together: that exchange is not hidden behind compute, but it costs one hop's host work where meeting the first
owners one by one cost ``g - 1`` hops (each hop's fixed host cost is what small hops are bound by).

Its backward (``ring_options.backward_owners_per_hop``) gathers and moves the weights the same way, and the
stacks' weight gradients trail them one group behind, also ``g`` ranks per hop. It is built in ``remat``'s form
(each hop recomputes its own activations):

    hop 0:          stack_0 gathered as forward
    group j:        part_j = hop_backward_group(step, j, *stack_j)   (group 0: in the sums' dtype)
                    ring_start(..., *stack_j [j < N/g-1], *grads_{j-1} [j >= 1], stride=g)
                    grads_j = accumulate(*incoming_j, *part_j)    [grads_0 = part_0; ``sum_in_place``: one
                                                                  hop_backward_group_into]
    returns:        slot s of grads_{N/g-1} (owner r+1+s) to its owner, s+1 ranks on: g transfers
    output:         finish(step, *returned)                       the owner sums the g sums it received

A gradient stack travels along the ranks ``r, r+g, r+2g, ...``: each of an owner's ``g`` returned sums holds the
contributions of one residue class of ranks mod ``g``, so the ``g`` together hold every rank's.

Token routing with ``g > 1`` (``ring_options.token_partitions_per_hop``) stacks ``g`` sources' tokens the same
way (stack ``j``: sources ``r - g j - g + 1 .. r - g j``, their rows one after the other), and its trailing sums
(``y``; backward ``dx``, ``d_scores``) follow the stacks as the expert backward's gradient sums do, each slot
returned to its source: the forward and the backward both take the expert backward's form above, with
``hop_forward_group`` (forward) or ``hop_backward_group`` computing a stack's pairs for this rank's experts.

The naive backward is what activation checkpointing of the whole block would do: a *replay* ring first
recomputes every hop's activations (``hop_recompute``, all kept alive), then the gradient ring consumes them
(``hop_vjp``). ``remat`` turns it into one ring whose hops recompute, consume and release.

Node metadata ``node.meta["ring"]`` is a ``RingNode``: which ring and hop a node belongs to and its role.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx
from torch import Tensor

from relay_compile.runtime.hop_compute import RingStep
from relay_compile.runtime.programs.instructions import (
    accumulate,
    finish,
    hop_forward,
    hop_forward_group,
    hop_recompute,
    hop_vjp,
    ring_start,
    ring_wait,
    hop_backward_group,
    stack_owners,
    unstack,
)
from relay_compile.runtime.programs.schedule import RingName, RingNode, RingSchedule


class _Builder:
    """Emits one ring's hops into a graph, tagging every node with its ``RingNode``."""

    def __init__(self, graph: fx.Graph, step: fx.Node, sched: RingSchedule) -> None:
        self.graph, self.step, self.sched = graph, step, sched

    def call(self, fn: Callable[..., object], args: tuple, meta: RingNode, kwargs: dict | None = None) -> fx.Node:
        node = self.graph.call_function(fn, args, kwargs)
        node.meta["ring"] = meta
        return node

    def call_items(self, fn: Callable[..., object], args: tuple, meta: RingNode, arity: int) -> list[fx.Node]:
        """``call``, then one ``getitem`` per result (all tagged ``meta``)."""
        node = self.call(fn, args, meta)
        items = []
        for i in range(arity):
            item = self.graph.call_function(operator.getitem, (node, i))
            item.meta["ring"] = meta
            items.append(item)
        return items

    def transfer(
        self, ring: RingName, hop: int, index: int, circ: list[fx.Node], trail: list[fx.Node], **where: int
    ) -> list[fx.Node]:
        """``ring_start`` + ``ring_wait``; ``where``: the start's ``stride`` / ``slot`` (grouped forward)."""
        start = self.call(ring_start, (self.step, index, hop, len(circ), *circ, *trail), RingNode(
            ring=ring, hop=hop, role="start"), where or None)
        return self.call_items(ring_wait, (start,), RingNode(ring=ring, hop=hop, role="wait"), len(circ) + len(trail))

    def ring(
        self, name: RingName, circ0: list[fx.Node], first_index: int,
        compute: Callable[[int, list[fx.Node]], list[fx.Node]],
    ) -> list[fx.Node]:
        """Emit N hops; ``compute(hop, circ) -> partial nodes``; returns the final trailing accumulators."""
        n, n_trail = self.sched.num_hops, self.sched.num_trailing if name != "replay" else 0
        circ, trail = circ0, list[fx.Node]()
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
                self.call_items(accumulate, (n_trail, *incoming, *partial),
                          RingNode(ring=name, hop=hop, role="accumulate"), n_trail)
                if hop >= 1 else partial
            )
        if n_trail and n > 1:
            trail = self.transfer(name, n, first_index + n, [], trail)  # the return to the owners
        return trail

    def gather_stack(self, ring: RingName, circ0: list[fx.Node]) -> list[fx.Node]:
        """A grouped ring's first owner stack (owners ``r-g+1 .. r``), gathered at hop 0: ``g - 1`` transfers,
        stride ``s`` bringing owner ``r-s`` into slot ``g-1-s`` (``overlap`` posts them together), and this
        rank's own weights in the last slot (``stack_owners``)."""
        g = self.sched.owners_per_hop
        slots = [t for s in range(1, g) for t in self.transfer(ring, 0, s - 1, circ0, [], stride=s, slot=g - 1 - s)]
        return self.call_items(stack_owners, (self.step, *slots), RingNode(ring=ring, hop=0, role="stack"),
                               len(circ0))

    def grouped_forward(self, circ0: list[fx.Node]) -> None:
        """Expert routing's forward, ``owners_per_hop`` owners per hop (module docstring)."""
        g, n = self.sched.owners_per_hop, self.sched.num_hops
        stack = self.gather_stack("forward", circ0)
        for group in range(n // g):
            if group:  # stack ``group`` arrives from ``g`` ranks back, sent at the previous hop
                stack = self.transfer("forward", group - 1, g - 2 + group, stack, [], stride=g)
            self.call(hop_forward_group, (self.step, group, *stack),
                      RingNode(ring="forward", hop=group, role="compute"))

    def grouped_trailing(self, ring: RingName, compute: Callable[..., object], circ0: list[fx.Node]
                         ) -> list[fx.Node]:
        """A grouped ring whose sums trail its stacks (module docstring: expert routing's backward, token
        routing's forward and backward), ``compute`` a stack's hop; returns the ``g`` sums returned to this rank,
        one after the other."""
        g, n, n_trail = self.sched.owners_per_hop, self.sched.num_hops, self.sched.num_trailing
        stack = self.gather_stack(ring, circ0)
        last = n // g - 1
        sums = list[fx.Node]()
        for group in range(last + 1):
            partial = self.call_items(compute, (self.step, group, *stack),
                                      RingNode(ring=ring, hop=group, role="compute"), n_trail)
            send = stack if group < last else []
            received = self.transfer(ring, group, g - 1 + group, send, sums, stride=g)
            stack, incoming = received[: len(send)], received[len(send):]
            sums = (self.call_items(accumulate, (n_trail, *incoming, *partial),
                                    RingNode(ring=ring, hop=group, role="accumulate"), n_trail)
                    if group else partial)
        returned = list[fx.Node]()
        for slot in range(g):  # slot s holds the sums of owner (source) r+1+s
            slot_sums = self.call_items(unstack, (self.step, slot, *sums),
                                        RingNode(ring=ring, hop=last + 1, role="stack"), n_trail)
            returned += self.transfer(ring, last + 1, g + last + slot, [], slot_sums, stride=slot + 1)
        return returned


def build_program(sched: RingSchedule) -> fx.GraphModule:
    """The naive program of a schedule (see the module docstring)."""
    graph = fx.Graph()
    step = graph.placeholder("step")
    circ0 = [graph.placeholder(f"circ{i}") for i in range(sched.num_circulating)]
    b = _Builder(graph, step, sched)
    n_trail = sched.num_trailing
    if sched.owners_per_hop > 1 and sched.direction == "backward":
        trail = b.grouped_trailing("grad", hop_backward_group, circ0)
    elif sched.owners_per_hop > 1 and n_trail:  # token routing: the y sums trail the stacks
        trail = b.grouped_trailing("forward", hop_forward_group, circ0)
    elif sched.owners_per_hop > 1:
        b.grouped_forward(circ0)
        trail = []
    elif sched.direction == "forward":
        def fwd(hop: int, circ: list[fx.Node]) -> list[fx.Node]:
            return b.call_items(hop_forward, (step, hop, *circ), RingNode(ring="forward", hop=hop, role="compute"),
                                n_trail)
        trail = b.ring("forward", circ0, 0, fwd)
    else:
        acts: dict[int, fx.Node] = {}

        def replay(hop: int, circ: list[fx.Node]) -> list[fx.Node]:
            acts[hop] = b.call(hop_recompute, (step, hop, *circ[: sched.num_replayed]),
                               RingNode(ring="replay", hop=hop, role="recompute"))
            return []

        def grad(hop: int, circ: list[fx.Node]) -> list[fx.Node]:
            return b.call_items(hop_vjp, (step, hop, acts[hop], *circ),
                                RingNode(ring="grad", hop=hop, role="compute"), n_trail)

        b.ring("replay", circ0[: sched.num_replayed], sched.num_hops + 1, replay)
        trail = b.ring("grad", circ0, 0, grad)
    out = graph.call_function(finish, (step, *trail))
    g = sched.owners_per_hop
    last = sched.num_hops if g == 1 else sched.num_hops // g
    out.meta["ring"] = RingNode(ring="grad" if sched.direction == "backward" else "forward", hop=last, role="finish")
    graph.output(out)
    graph.lint()
    grouped = f"_{sched.owners_per_hop}owners" if sched.owners_per_hop > 1 else ""
    return fx.GraphModule(torch.nn.Module(), graph,
                          class_name=f"RingProgram_{sched.direction}_{sched.routing}{grouped}")


def run_program(program: fx.GraphModule, step: RingStep, circulating: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """Execute a program on a bound step (eagerly: it already runs inside a custom op)."""
    return program(step, *circulating)

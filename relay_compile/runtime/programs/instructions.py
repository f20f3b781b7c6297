"""The instruction set of ring programs: the functions whose calls make up a program's nodes.

Each instruction is a thin call into the two runtime layers below: ``RingStep`` (what a hop computes,
``runtime.hop_compute``) and ``RingTransfer`` (one hop's P2P transfer, ``runtime.transport``). The
program passes (``remat``, ``overlap``) recognize nodes by these targets. Every instruction is registered
as side-effecting: hops mutate the step's accumulators and transfers move data, so dead-code elimination
must keep them.
"""

from __future__ import annotations

import torch.fx as fx
from torch import Tensor

from relay_compile.runtime.hop_compute import HopActivations, RingStep
from relay_compile.runtime.token_routing_step import TokenRoutingStep
from relay_compile.runtime.transport import RingTransfer, start_transfer


def ring_start(
    step: RingStep, index: int, hop: int, num_circulating: int, *payload: Tensor, stride: int = 1,
    slot: int | None = None,
) -> RingTransfer:
    """Post transfer ``index`` (tags), sent at ``hop`` of its ring: ``payload[:num_circulating]`` moves on,
    the rest are trailing accumulators, posted first as a batch of their own where the step's hops add into them
    on arrival (``sums_travel_first``; ``start_transfer``'s ``trailing_from``). ``stride``: sent ``stride`` ranks
    on (received from as many back); ``slot``: received into that slot of the step's first owner stack (a grouped
    ring's gather).
    """
    receive = step.receive_buffers(hop, num_circulating, payload, slot=slot)
    return start_transfer(step.cfg.ring, index, list(payload), receive, stride=stride,
                          trailing_from=num_circulating if step.sums_travel_first else None)


def ring_wait(transfer: RingTransfer) -> tuple[Tensor, ...]:
    """Block until a transfer completes; its receive buffers."""
    return transfer.wait()


def hop_forward(step: RingStep, hop: int, *circulating: Tensor) -> tuple[Tensor, ...]:
    """Forward hop: the pairs that meet here; returns trailing partials (token routing) or ``()``."""
    return step.forward_hop(hop, *circulating)


def stack_owners(step: RingStep, *slots: Tensor) -> tuple[Tensor, ...]:
    """A grouped ring's first stack, complete once ``slots`` (what the gather's transfers received into it) have
    arrived: this rank's own partition (weights, or tokens) is copied into its last slot."""
    return step.stack_owners()


def unstack(step: RingStep, slot: int, *stacked: Tensor) -> tuple[Tensor, ...]:
    """Slot ``slot`` of the last stack's trailing sums (one owner's or source's part of each), views."""
    return step.unstack(slot, *stacked)


def hop_forward_group(step: RingStep, group: int, *stacked: Tensor) -> tuple[Tensor, ...]:
    """Grouped forward hop: the pairs that meet stack ``group`` (``stacked``: the owners' weights, or the
    sources' tokens); returns trailing partials (token routing) or ``()``."""
    return step.forward_group(group, *stacked)


def hop_forward_into(step: RingStep, hop: int, transfer: RingTransfer, first: int, *circulating: Tensor
                     ) -> tuple[Tensor, ...]:
    """Forward hop that adds into the trailing sums arriving with ``transfer`` (token routing's ``y``), waiting
    for them only when about to add; returns those sums."""
    assert isinstance(step, TokenRoutingStep), "hop_forward_into: a forward's sums trail token routing only"
    return step.forward_hop_into(hop, transfer, first, *circulating)


def hop_forward_group_into(step: RingStep, group: int, transfer: RingTransfer, first: int, *stacked: Tensor
                           ) -> tuple[Tensor, ...]:
    """``hop_forward_group`` adding into the stack's ``y`` sums arriving with ``transfer``; returns them."""
    assert isinstance(step, TokenRoutingStep), "hop_forward_group_into: a forward's sums trail token routing only"
    return step.forward_group_into(group, transfer, first, *stacked)


def hop_backward(step: RingStep, hop: int, *circulating: Tensor) -> tuple[Tensor, ...]:
    """Backward hop with hop-scoped recomputation (chunk by chunk); returns trailing partials."""
    return step.backward_hop(hop, *circulating)


def hop_backward_group(step: RingStep, group: int, *stacked: Tensor) -> tuple[Tensor, ...]:
    """Grouped backward hop: the pairs that meet stack ``group``; returns the stack's trailing partials (its
    weight gradients, or its tokens' ``dx`` and ``d_scores``)."""
    return step.backward_group(group, *stacked)


def hop_backward_group_into(step: RingStep, group: int, transfer: RingTransfer, first: int, *stacked: Tensor
                            ) -> tuple[Tensor, ...]:
    """``hop_backward_group`` adding into the stack's trailing sums arriving with ``transfer``; returns them."""
    return step.backward_group_into(group, transfer, first, *stacked)


def hop_backward_into(step: RingStep, hop: int, transfer: RingTransfer, first: int, *circulating: Tensor
                      ) -> tuple[Tensor, ...]:
    """Backward hop that adds into the trailing sums arriving with ``transfer`` (its received tensors from
    ``first`` on: expert routing's weight gradients, token routing's ``dx`` and ``d_scores``), waiting for them
    only when about to add; returns those sums."""
    return step.backward_hop_into(hop, transfer, first, *circulating)


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


INSTRUCTIONS = (
    ring_start, ring_wait, stack_owners, unstack, hop_forward, hop_forward_group, hop_forward_into,
    hop_forward_group_into, hop_backward, hop_backward_into, hop_backward_group, hop_backward_group_into,
    hop_recompute, hop_vjp, accumulate, finish,
)
# The hop instructions that compute (``overlap`` schedules transfers around them).
COMPUTE = (hop_forward, hop_forward_group, hop_forward_into, hop_forward_group_into, hop_backward,
           hop_backward_into, hop_backward_group, hop_backward_group_into, hop_vjp)

for _fn in INSTRUCTIONS:
    fx.node.has_side_effect(_fn)

"""The ``relaymoe`` custom ops: the autograd boundary of a ring, and the trampolines into ring programs.

    relaymoe::ring_moe(x, topk_ids, topk_scores, weights[], spec) -> y
    relaymoe::ring_moe_backward(grad_y, x, topk_ids, topk_scores, weights[], spec) -> [dx, d_scores, *d_weights]

``spec`` is the key of a registered ``RingSpec`` (``runtime.specs``). The backward is an op of its own so
that the ring runs at run time under aot_autograd (a Python ``register_autograd`` backward runs only while
tracing). Both ops have fake implementations, so they trace under torch.compile without communicating.

Per call: the spec's first-call agreement across ranks (``specs.agree_on_first_call``), one ``RingStep``
(``hop_compute``: what the hops compute), and the spec's program (``programs.pipeline.program_for``: when).
"""

from __future__ import annotations

import torch
from torch import Tensor

from relay_compile.runtime.hop_compute import ExpertRoutingStep, RingStepConfig, TokenRoutingStep
from relay_compile.runtime.programs.build import run_program
from relay_compile.runtime.programs.pipeline import program_for
from relay_compile.runtime.programs.schedule import Direction
from relay_compile.runtime.specs import agree_on_first_call, spec_state
from relay_compile.runtime.transport import RingGroup


def _run(
    direction: Direction, key: str, x: Tensor, topk_ids: Tensor, topk_scores: Tensor, weights: list[Tensor],
    grad_y: Tensor | None = None,
) -> tuple[Tensor, ...]:
    state = spec_state(key)
    ring = RingGroup.resolve(state.spec.group_name)
    if ring != state.ring:
        # The group behind the name was destroyed and created anew (tests, elastic restarts): check again.
        state.ring, state.resolved = ring, None
    routing = agree_on_first_call(state, x, topk_ids, weights)
    spec = state.spec
    cfg = RingStepConfig(
        expert_fn=spec.expert_fn, ring=state.ring, num_experts=spec.experts_per_rank * state.ring.size,
        max_hop_rows=spec.options.max_hop_rows,
    )
    step_cls = ExpertRoutingStep if routing == "expert" else TokenRoutingStep
    step = step_cls(cfg, x, topk_ids, topk_scores, weights, grad_y)
    program = program_for(spec, direction, routing, state.ring.size, len(weights))
    assert len(step.weights) == spec.circulating_weights(len(weights)), (
        f"ring_moe: the expert function packs {len(weights)} weights into {len(step.weights)} tensors, "
        f"not the {spec.circulating_weights(len(weights))} its num_packed promises"
    )
    return run_program(program, step, step.initial_circulating())


@torch.library.custom_op("relaymoe::ring_moe", mutates_args=())
def ring_moe_op(x: Tensor, topk_ids: Tensor, topk_scores: Tensor, weights: list[Tensor], spec: str) -> Tensor:
    """``y[t] = sum_k scores[t, k] * F_{ids[t, k]}(x[t])`` by a ring over the spec's EP group."""
    with torch.no_grad():
        return _run("forward", spec, x, topk_ids, topk_scores, weights)[0]


@ring_moe_op.register_fake
def _(x: Tensor, topk_ids: Tensor, topk_scores: Tensor, weights: list[Tensor], spec: str) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("relaymoe::ring_moe_backward", mutates_args=())
def ring_moe_backward_op(
    grad_y: Tensor, x: Tensor, topk_ids: Tensor, topk_scores: Tensor, weights: list[Tensor], spec: str
) -> list[Tensor]:
    """``[dx, d_scores, *d_weights]`` of ``ring_moe``: the backward ring (recompute per hop)."""
    return list(_run("backward", spec, x, topk_ids, topk_scores, weights, grad_y.contiguous()))


@ring_moe_backward_op.register_fake
def _(
    grad_y: Tensor, x: Tensor, topk_ids: Tensor, topk_scores: Tensor, weights: list[Tensor], spec: str
) -> list[Tensor]:
    return [torch.empty_like(x), torch.empty_like(topk_scores), *(torch.empty_like(w) for w in weights)]


def _setup_context(ctx, inputs, output) -> None:
    x, topk_ids, topk_scores, weights, spec = inputs
    ctx.save_for_backward(x, topk_ids, topk_scores, *weights)
    ctx.spec = spec


def _backward(ctx, grad_y: Tensor):
    x, topk_ids, topk_scores, *weights = ctx.saved_tensors
    dx, d_scores, *d_weights = torch.ops.relaymoe.ring_moe_backward(
        grad_y, x, topk_ids, topk_scores, list(weights), ctx.spec
    )
    return dx, None, d_scores, d_weights, None


ring_moe_op.register_autograd(_backward, setup_context=_setup_context)

# The forward op's overload: what the rewrite pass inserts into Dynamo graphs.
RING_MOE = torch.ops.relaymoe.ring_moe.default

"""The ``relaymoe`` custom ops: the autograd boundary of a ring, and the trampolines into ring programs.

    relaymoe::ring_moe(x, topk_ids, topk_scores, weights[], spec) -> y
    relaymoe::ring_moe_backward(grad_y, x, topk_ids, topk_scores, weights[], spec) -> [dx, d_scores, *d_weights]

``spec`` names a registered ``RingSpec`` (expert function, group, routing, options): custom ops cannot take
callables, and a string keeps compiled graphs printable and cacheable. The backward is an op of its own so
that the ring runs at run time under aot_autograd (a Python ``register_autograd`` backward runs only while
tracing). Both ops have fake implementations, so they trace under torch.compile without communicating.

At the first call of a spec, every rank checks once, with one small all-gather, that all ranks pass weights
of the same shapes and dtype (a mismatch would make the ring's receives wrong), and ``routing="auto"`` is
resolved from the shapes of all ranks, so every rank takes the same decision.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import Tensor

from relay_compile.experts import ExpertFn
from relay_compile.passes import overlap_pass, remat_pass
from relay_compile.ring_program import Direction, RingSchedule, build_program, run_program, schedule_for
from relay_compile.routing import Routing, choose_routing, per_hop_bytes
from relay_compile.runtime.hop_compute import ExpertRoutingStep, RingStepConfig, TokenRoutingStep
from relay_compile.runtime.transport import RingGroup, all_gather_rows

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RingSpec:
    """Everything about a ring that is not a tensor. Identical on every rank."""

    expert_fn: ExpertFn
    experts_per_rank: int
    group_name: str
    routing: str = "auto"
    overlap: bool = True
    remat: bool = True
    max_hop_rows: int | None = None


@dataclass(kw_only=True)
class _SpecState:
    spec: RingSpec
    ring: RingGroup
    resolved: Routing | None = None
    volumes: dict[str, dict[str, int]] = field(default_factory=dict)


_SPECS: dict[str, _SpecState] = {}


def register_spec(key: str, spec: RingSpec) -> str:
    """Register ``spec`` under ``key`` (idempotent for an equal spec); returns the key."""
    state = _SPECS.get(key)
    if state is not None and state.spec != spec:
        raise ValueError(f"relaymoe: ring spec {key!r} is already registered with other settings")
    if state is None:
        _SPECS[key] = _SpecState(spec=spec, ring=RingGroup.resolve(spec.group_name))
    return key


def spec_state(key: str) -> _SpecState:
    try:
        return _SPECS[key]
    except KeyError:
        raise KeyError(f"relaymoe: no ring spec {key!r} registered in this process") from None


# Dtypes as small ints for the shape check (any fixed numbering works: every rank uses this table).
_DTYPE_CODES = {dt: i for i, dt in enumerate(
    (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2))}
_SIGNATURE_LEN = 24


def _signature(x: Tensor, topk_ids: Tensor, weights: list[Tensor]) -> Tensor:
    """``[T, H, K, dtype, nweights, *shapes]`` as a fixed-length int64 row (T is the only per-rank size)."""
    row = [x.shape[0], x.shape[1], topk_ids.shape[1], _DTYPE_CODES.get(x.dtype, 99), len(weights)]
    for w in weights:
        row += [w.dim(), *w.shape, _DTYPE_CODES.get(w.dtype, 99)]
    if len(row) > _SIGNATURE_LEN:
        row = row[:5] + [hash(tuple(row[5:])) % (1 << 62)]
    return torch.tensor(row + [0] * (_SIGNATURE_LEN - len(row)), dtype=torch.int64, device=x.device)


def _resolve(state: _SpecState, x: Tensor, topk_ids: Tensor, weights: list[Tensor]) -> Routing:
    """First call of a spec: check shapes across ranks and pick the routing, identically on every rank."""
    if state.resolved is not None:
        return state.resolved
    table = all_gather_rows(state.ring, _signature(x, topk_ids, weights)).tolist()
    for rank, row in enumerate(table):
        if row[1:] != table[state.ring.rank][1:]:
            raise ValueError(
                f"ring_moe: rank {rank} of the EP group passes hidden size, top-k, dtype or weight shapes "
                f"{row[1:]} that differ from rank {state.ring.rank}'s {table[state.ring.rank][1:]}; every rank "
                "must hold expert partitions of one shape"
            )
    spec = state.spec
    elem = x.element_size()
    volume_args = dict(
        tokens=max(row[0] for row in table), hidden=x.shape[1], top_k=topk_ids.shape[1],
        experts_per_rank=spec.experts_per_rank, elem_bytes=elem,
        expert_bytes=sum(w.numel() * w.element_size() for w in weights) // spec.experts_per_rank,
    )
    state.volumes = {mode: per_hop_bytes(mode, **volume_args) for mode in ("expert", "token")}
    state.resolved = choose_routing(**volume_args) if spec.routing == "auto" else spec.routing  # type: ignore[assignment]
    log.info("ring_moe: routing %s (asked %s), per-hop bytes %s", state.resolved, spec.routing, state.volumes)
    return state.resolved


@functools.cache
def ring_program(sched: RingSchedule, overlap: bool, remat: bool) -> fx.GraphModule:
    """The shaped program of a schedule: naive build, then ``remat`` (backward) and ``overlap``."""
    gm = build_program(sched)
    if remat and sched.direction == "backward":
        gm = remat_pass(gm)
    if overlap:
        gm = overlap_pass(gm)
    return gm


def _run(
    direction: Direction, key: str, x: Tensor, topk_ids: Tensor, topk_scores: Tensor, weights: list[Tensor],
    grad_y: Tensor | None = None,
) -> tuple[Tensor, ...]:
    state = spec_state(key)
    ring = RingGroup.resolve(state.spec.group_name)
    if ring != state.ring:
        # The group behind the name was destroyed and created anew (tests, elastic restarts): check again.
        state.ring, state.resolved = ring, None
    routing = _resolve(state, x, topk_ids, weights)
    spec = state.spec
    cfg = RingStepConfig(
        expert_fn=spec.expert_fn, ring=state.ring, num_experts=spec.experts_per_rank * state.ring.size,
        max_hop_rows=spec.max_hop_rows,
    )
    step_cls = ExpertRoutingStep if routing == "expert" else TokenRoutingStep
    step = step_cls(cfg, x, topk_ids, topk_scores, weights, grad_y)
    # The step's weights are in the expert function's packed layout: their count sizes the program.
    program = ring_program(
        schedule_for(direction, routing, state.ring.size, len(step.weights)), spec.overlap, spec.remat
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

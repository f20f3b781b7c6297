"""The ``relaymoe`` custom ops: the autograd boundary of a ring, and the trampolines into ring programs.

    relaymoe::ring_moe(x, topk_ids, topk_scores, weights[], spec) -> (y, counts_E)
    relaymoe::ring_moe_saving(x, topk_ids, topk_scores, weights[], spec) -> (y, projections, counts_E)
    relaymoe::ring_moe_backward(grad_y, x, topk_ids, topk_scores, weights[], spec, projections?, counts_E?)
        -> [dx, d_scores, *d_weights]

``spec`` is the key of a registered ``RingSpec`` (``runtime.specs``). The backward is an op of its own so that
the ring runs at run time under aot_autograd (a Python ``register_autograd`` backward runs only while tracing).
The ops have fake implementations, so they trace under torch.compile without communicating.

``counts_E`` (int64, on the host, not differentiable): this rank's pairs per expert as the forward's agreement
read them, handed to the backward so that its agreement needs nothing the device computes: its exchange then runs
beside the compute stream (``agreement._exchange``) instead of waiting there for everything queued since the
forward (the rest of the forward, the loss, the later layers' backward) while the device idles.

``ring_moe_saving`` (option ``save_projections``) also returns every pair's first projection ``(T*K, U)`` (the
packed first matrix's columns and dtype) in the step's sorted-pair order, which its backward reads instead of
recomputing that GEMM per hop; it holds them from forward to backward, so it is emitted only where that memory
is granted (``runtime.saved_projections``). Where a call does not run as a saving expert ring (the agreement
chose the all-to-all or token routing, or a rank cannot save), the projections are left unwritten and the
backward, which decides alike from the same agreed values (``decision.decide`` reads no direction), does
not read them.

Per call:

1. local preparation: the arguments' checks, expert-id counts, the weights' packing; any error here becomes
   this rank's problem instead of leaving the op;
2. the agreement (``runtime.agreement.agree``): one exchange, every rank raises alike on a problem or a
   disagreement, ``routing="auto"`` resolved;
3. one ``RingStep`` (``hop_compute``: what the hops compute) and the spec's program
   (``programs.pipeline.program_for``: when), run inside a ``transport.RingRun``: a failure inside a hop
   drains the ring and raises after the last transfer; nothing is left posted when the op raises. A peer's
   failure is raised at the end of the op, or (status on an accelerator) at the group's next exchange.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from relay_compile.routing import PairRouting, summed_bytes
from relay_compile.runtime import equal_groups, program_dumps
from relay_compile.runtime.agreement import (
    Agreement,
    BadArgument,
    Claims,
    agree,
    agree_kept,
    remember_status,
)
from relay_compile.runtime.block_shape import OwnerOptions, stacks_of, token_partitions
from relay_compile.runtime.cost_model import calibration_code, calibration_for
from relay_compile.runtime.decision import BlockSizes
from relay_compile.runtime.all_to_all import AllToAllStep
from relay_compile.runtime.hop_compute import ExpertRoutingStep, RingStepConfig
from relay_compile.runtime.ring_step import clamped_ids
from relay_compile.runtime.token_routing_step import TokenRoutingStep
from relay_compile.runtime.programs.build import run_program
from relay_compile.runtime.programs.pipeline import hop_owners, program_for
from relay_compile.runtime.programs.schedule import Direction, RingSchedule
from relay_compile.runtime.queued_ahead import QueuedAhead
from relay_compile.runtime.ring_options import HopShape, MaxHopRows, hop_row_bound
from relay_compile.runtime.saved_projections import can_save
from relay_compile.runtime.specs import SpecState, holding, spec_held, spec_state
from relay_compile.runtime.transport import RingGroup, RingRun
from relay_compile.runtime.weight_grads import pack_weights

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class _Local:
    """What a rank prepares before the agreement: its claims, and what the step reuses."""

    claims: Claims
    bad_ids: Tensor  # on the tokens' device
    counts_E: Tensor  # on the tokens' device; in a backward given the forward's, those (on the host)
    packed: list[Tensor] | None = None
    agreed: bool = False  # counts_E are the forward's, which its agreement checked


def check_routing_args(x: Tensor, topk_ids: Tensor, topk_scores: Tensor) -> None:
    """Shapes and dtypes of the routing arguments; ``BadArgument`` naming the argument."""
    if x.dim() != 2:
        raise BadArgument("x", f"ring_moe: x must be (T, H) local tokens, got shape {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise BadArgument("topk_ids", (
            f"ring_moe: topk_ids must be (T, K) with T = x.shape[0] = {x.shape[0]}, got {tuple(topk_ids.shape)}"))
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise BadArgument("topk_ids", f"ring_moe: topk_ids must hold integer expert ids, got dtype {topk_ids.dtype}")
    if topk_scores.shape != topk_ids.shape:
        raise BadArgument("topk_scores", (
            f"ring_moe: topk_scores must have topk_ids' shape {tuple(topk_ids.shape)}, got {tuple(topk_scores.shape)}"))
    if not topk_scores.dtype.is_floating_point:
        raise BadArgument("topk_scores", f"ring_moe: topk_scores must be floating point, got {topk_scores.dtype}")


def _check_grad(x: Tensor, grad_y: Tensor | None) -> None:
    if grad_y is not None and (grad_y.shape != x.shape or grad_y.dtype != x.dtype):
        raise BadArgument("grad_y", (
            f"ring_moe: grad_y must have x's shape and dtype {tuple(x.shape)} {x.dtype}, got "
            f"{tuple(grad_y.shape)} {grad_y.dtype}"))


def _prepare(
    direction: Direction, state: SpecState, cfg: RingStepConfig, x: Tensor, topk_ids: Tensor, topk_scores: Tensor,
    weights: Sequence[Tensor], grad_y: Tensor | None, saving: bool = False, agreed_counts_E: Tensor | None = None,
) -> _Local:
    """Step 1 of the module docstring: this rank's claims; an error becomes its problem. ``saving``: the op
    saves (forward) or was given (backward) projections; claimed where the ring can (``Claims.saves``).
    ``agreed_counts_E``: the forward's host counts (backward)."""
    spec = state.spec
    no_counts = torch.zeros(0, dtype=torch.int64, device=x.device)
    try:
        check_routing_args(x, topk_ids, topk_scores)
        _check_grad(x, grad_y)
        _check_agreed_counts(agreed_counts_E, cfg.num_experts)
        if agreed_counts_E is None:
            ids_TK, bad = clamped_ids(cfg.num_experts, topk_ids)
            counts_E = PairRouting.counts(ids_TK, cfg.num_experts)
        else:  # the forward's, checked by its agreement (no bad ids): not counted again on the device
            bad, counts_E = no_counts.new_zeros(1), agreed_counts_E
        packed = pack_weights(cfg.grouped, weights)
        circulating = len(packed)
        assert circulating == spec.circulating_weights(len(weights)), (
            f"ring_moe: the expert function packs {len(weights)} weights into {circulating} tensors, "
            f"not the {spec.circulating_weights(len(weights))} its num_packed promises"
        )
    except Exception as e:  # noqa: BLE001 -- any local failure: reported in the exchange, no peer waits on it
        return _Local(claims=Claims(direction=direction, problem=e), bad_ids=no_counts.new_zeros(1),
                      counts_E=no_counts)
    claims = Claims(
        direction=direction, tokens=x.shape[0], hidden=x.shape[1], top_k=topk_ids.shape[1],
        dtypes=(x.dtype, topk_ids.dtype, topk_scores.dtype, None if grad_y is None else grad_y.dtype),
        experts_per_rank=spec.experts_per_rank, options=spec.options, expert_fn=state.identity_code,
        scores_before=spec.scores_applied == "before",
        weights=tuple((w.dtype, tuple(w.shape)) for w in weights), cuda=x.device.type == "cuda",
        machine=calibration_code(calibration_for(x.device)), link_gbps=state.link_gbps,
        saves=spec.options.saves_code if saving and can_save(cfg.expert_fn, spec.options, spec.scores_applied,
                                                             x.device) else 0,
    )
    return _Local(claims=claims, bad_ids=bad, counts_E=counts_E, packed=packed, agreed=agreed_counts_E is not None)


def _check_agreed_counts(counts_E: Tensor | None, num_experts: int) -> None:
    if counts_E is not None and (counts_E.shape != (num_experts,) or counts_E.dtype != torch.int64
                                 or counts_E.device.type != "cpu"):
        raise BadArgument("the call", (
            f"ring_moe_backward: counts_E must be the forward's (E,) = ({num_experts},) int64 host counts, got "
            f"{tuple(counts_E.shape)} {counts_E.dtype} on {counts_E.device}"))


def _run(
    direction: Direction, key: str, x: Tensor, topk_ids: Tensor, topk_scores: Tensor, weights: list[Tensor],
    grad_y: Tensor | None = None, projections: Tensor | bool = False, agreed_counts_E: Tensor | None = None,
) -> tuple[tuple[Tensor, ...], Tensor | None]:
    """One call of the ring (the module docstring's steps): its outputs, and (forward) this rank's agreed counts
    on the host (``counts_E``). ``projections``: the forward saves them (True), the backward reads the forward's (a
    tensor), where the call runs as an expert ring that can (``saved_projections.can_save``);
    ``agreed_counts_E``: the forward's counts (backward)."""
    state = spec_state(key)
    ring = RingGroup.resolve(state.spec.group_name)
    if ring != state.ring:
        state.rebind(ring)
    spec = state.spec
    cfg = RingStepConfig(
        expert_fn=spec.ring_fn, ring=ring, num_experts=spec.experts_per_rank * ring.size,
        max_hop_rows=hop_row_bound(spec.options.max_hop_rows, x.shape[0], forward=direction == "forward"),
        acc_dtype=torch.float32 if spec.options.fp32_accumulation else None,
        scores_before=spec.scores_applied == "before", chunk_graphs=spec.options.graphs_on(x.device),
        equal_groups=equal_groups.applies(x.device), gather_in_gemm=spec.options.gather_in_gemm,
        add_in_gemm=spec.options.add_in_gemm,
    )
    local = _prepare(direction, state, cfg, x, topk_ids, topk_scores, weights, grad_y, projections is not False,
                     agreed_counts_E)
    # The sort and the sum need no count: queued while the host waits for the table (a failed call queues none).
    ahead = QueuedAhead(state.resolved if local.claims.problem is None else None, cfg, x, topk_ids, topk_scores)
    fp32 = spec.options.fp32_accumulation
    agreed = agree(ring, local.claims, local.bad_ids, local.counts_E,
                   # What circulates: the packed weights (FP8 hops: half the bytes), else the given ones.
                   weight_bytes=sum(w.numel() * w.element_size() for w in local.packed or weights),
                   elem_bytes=x.element_size(),
                   grad_bytes=sum(w.numel() * summed_bytes(w.element_size(), fp32) for w in weights),
                   sum_elem_bytes=summed_bytes(x.element_size(), fp32),
                   sizes=_block_sizes(spec.options.max_hop_rows, cfg, x, topk_ids, local.packed),
                   counts_agreed=local.agreed, before_read=ahead.queue)
    if agreed.execution != state.resolved:
        log.info("ring_moe: runs as %s (routing asked %s, ring %s): %s; per-hop bytes %s", agreed.execution,
                 spec.options.routing, spec.options.ring, agreed.choice.reason if agreed.choice else "no cost model",
                 agreed.volumes)
    state.resolved, state.volumes, state.choice = agreed.execution, agreed.volumes, agreed.choice
    assert local.packed is not None, "ring_moe: an agreed call has its weights packed"
    reason = agreed.choice.reason if agreed.choice else f"routing {spec.options.routing}"
    counts_E = _own_counts(agreed, ring.rank) if direction == "forward" else None
    order, sum_TH = ahead.take(agreed.execution)
    if agreed.execution == "all_to_all":
        program_dumps.record(key, direction, "all_to_all", reason, tokens_N=agreed.counts.tokens_N)
        a2a = AllToAllStep(cfg, x, topk_ids, topk_scores, weights, grad_y, counts=agreed.counts,
                           counts_E=local.counts_E.to(x.device), packed=local.packed, order=order)
        if direction == "backward":
            return a2a.backward(), counts_E
        return a2a.forward() + ((_unwritten(local.packed, topk_ids),) if projections is True else ()), counts_E
    saving = projections if agreed.saves else False
    owners = _owners(agreed, direction, cfg, x, topk_ids, local.packed)
    program = program_for(spec, direction, agreed.routing, ring.size, len(weights), owners)
    program_dumps.record(key, direction, agreed.routing, reason, tokens_N=agreed.counts.tokens_N, program=program,
                         owners=owners)
    step_cls = ExpertRoutingStep if agreed.routing == "expert" else TokenRoutingStep
    queued = {"order": order, "sum_TH": sum_TH} if step_cls is ExpertRoutingStep else {}
    # Failure status travels only where results depend on other ranks' hops (trailing accumulators).
    sched: RingSchedule = program.meta["schedule"]
    with RingRun(ring, x.device, direction, carries_status=sched.num_trailing > 0) as run:
        step = step_cls(cfg, x, topk_ids, topk_scores, weights, grad_y, counts=agreed.counts, packed=local.packed,
                        owners_per_hop=owners, **queued, **({} if saving is False else {"projections": saving}))
        out = run_program(program, step, step.initial_circulating())
    remember_status(ring, run.outcome())  # raises this rank's failure, or a peer's where reading it is free
    if projections is True and saving is False:  # a saving op's call that does not save
        out = (*out, _unwritten(local.packed, topk_ids))
    return out, counts_E


def _owners(agreed: Agreement, direction: Direction, cfg: RingStepConfig, x: Tensor, topk_ids: Tensor,
            packed: Sequence[Tensor]) -> int:
    """Owners per hop of this call's ring: the cost model's (``Choice.owners``: the rules', or a larger stack where
    the rules' ring would lose to the all-to-all) where it decided, else the rules' (``hop_owners``)."""
    if agreed.choice is not None and agreed.routing == "expert" and cfg.grouped is not None:
        return agreed.choice.owners[0 if direction == "forward" else 1]
    return hop_owners(direction, agreed.routing, cfg.grouped is not None,
                      _hop_shape(cfg.ring.size, agreed.counts.tokens_N, topk_ids, x, packed))


def _own_counts(agreed: Agreement, rank: int) -> Tensor:
    """This rank's agreed pairs per expert on the host: the forward op's ``counts_E`` (module docstring)."""
    own = agreed.counts.counts_NE[rank]
    assert own is not None, "ring_moe: an agreement always reads this rank's own counts"
    return torch.tensor(own, dtype=torch.int64)


def _unwritten(packed: Sequence[Tensor], topk_ids: Tensor) -> Tensor:
    """The projections a saving op returns where its call does not save: ``(T*K, U)`` in the packed first
    matrix's columns and dtype (as ``hop_compute.ExpertRoutingStep`` allocates them), never written nor read.
    They are held until the backward like saved ones: that memory is lost where the op was chosen to save and the
    call did not (another rank cannot, the agreement chose the all-to-all or token routing)."""
    first = packed[0]
    return first.new_empty((topk_ids.numel(), first.shape[1]))


def _hop_shape(size: int, tokens_N: list[int], topk_ids: Tensor, x: Tensor, packed: Sequence[Tensor]) -> HopShape:
    return HopShape.of(size, tokens_N, topk_ids.shape[1], [(w.shape, w.numel() * w.element_size()) for w in packed],
                       x.shape[1], x.element_size())


def _block_sizes(max_hop_rows: MaxHopRows, cfg: RingStepConfig, x: Tensor, topk_ids: Tensor,
                 packed: Sequence[Tensor] | None) -> BlockSizes | None:
    """The cost model's sizes from the circulating weights' ``(E_l, out, in)`` matrices (None: none to read).
    Forward and backward calls predict the same forward + backward (both directions' owners per hop), so they
    decide alike."""
    matrices = [w.shape for w in packed or () if w.dim() == 3]
    if not matrices:
        return None
    size = cfg.ring.size
    return BlockSizes(
        ffn=min(min(m[1], m[2]) for m in matrices), expert_params=sum(m[1] * m[2] for m in matrices),
        max_hop_rows=max_hop_rows,
        owners=lambda tokens_N: _owner_options(cfg, _hop_shape(size, tokens_N, topk_ids, x, packed or ())),
    )


def _owner_options(cfg: RingStepConfig, hop: HopShape) -> OwnerOptions:
    """What the ring may hold per hop at ``hop``: the expert rules' owners and, for grouped experts, larger
    stacks (``ring_options.larger_owners``), an expert function without grouped entry points one owner; token
    routing's sources (any expert function)."""
    return OwnerOptions((1, 1), token=token_partitions(hop)) if cfg.grouped is None else stacks_of(hop)


@torch.library.custom_op("relaymoe::ring_moe", mutates_args=())
def ring_moe_op(
    x: Tensor, topk_ids: Tensor, topk_scores: Tensor, weights: list[Tensor], spec: str
) -> tuple[Tensor, Tensor]:
    """``y[t] = sum_k scores[t, k] * F_{ids[t, k]}(x[t])`` (or ``F_{ids[t, k]}(scores[t, k] * x[t])``, the
    spec's ``scores_applied``) by a ring over the spec's EP group; and the agreed ``counts_E`` (module docstring)."""
    with torch.no_grad():
        (y,), counts_E = _run("forward", spec, x, topk_ids, topk_scores, weights)
    assert counts_E is not None
    return y.contiguous(), counts_E


# The fakes promise contiguous results whatever the inputs' strides (transposed scores, as a capacity region's
# pairs are; weights viewed transposed), and the ops return them so: compilers check the strides a fake gives.
_CONTIGUOUS = torch.contiguous_format


def _fake_counts(spec: str) -> Tensor:
    """``counts_E``'s fake: ``(E,)`` int64 on the host, E from the spec and its group (registered before any
    trace that calls these ops)."""
    state = spec_state(spec)
    return torch.empty(state.spec.experts_per_rank * state.ring.size, dtype=torch.int64, device="cpu")


@ring_moe_op.register_fake
def _(x: Tensor, topk_ids: Tensor, topk_scores: Tensor, weights: list[Tensor], spec: str) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x, memory_format=_CONTIGUOUS), _fake_counts(spec)


@torch.library.custom_op("relaymoe::ring_moe_saving", mutates_args=())
def ring_moe_saving_op(
    x: Tensor, topk_ids: Tensor, topk_scores: Tensor, weights: list[Tensor], spec: str
) -> tuple[Tensor, Tensor, Tensor]:
    """``ring_moe`` that also returns every pair's first projection for its backward (module docstring)."""
    with torch.no_grad():
        (y, projections), counts_E = _run("forward", spec, x, topk_ids, topk_scores, weights, projections=True)
    assert counts_E is not None
    return y.contiguous(), projections, counts_E


@ring_moe_saving_op.register_fake
def _(
    x: Tensor, topk_ids: Tensor, topk_scores: Tensor, weights: list[Tensor], spec: str
) -> tuple[Tensor, Tensor, Tensor]:
    # The packed layout of fake weights (no memory): the spec is registered before any trace that calls this op.
    packed = spec_state(spec).spec.ring_fn.pack(weights)  # type: ignore[attr-defined]
    return torch.empty_like(x, memory_format=_CONTIGUOUS), _unwritten(packed, topk_ids), _fake_counts(spec)


@torch.library.custom_op("relaymoe::ring_moe_backward", mutates_args=())
def ring_moe_backward_op(
    grad_y: Tensor, x: Tensor, topk_ids: Tensor, topk_scores: Tensor, weights: list[Tensor], spec: str,
    projections: Tensor | None = None, counts_E: Tensor | None = None,
) -> list[Tensor]:
    """``[dx, d_scores, *d_weights]`` of ``ring_moe``: the backward ring (recompute per hop, or read the
    forward's ``projections``), agreed with the forward's host ``counts_E`` where given."""
    saved: Tensor | bool = False if projections is None else projections
    grads, _ = _run("backward", spec, x, topk_ids, topk_scores, weights, grad_y.contiguous(), projections=saved,
                    agreed_counts_E=counts_E)
    return [g.contiguous() for g in grads]


@ring_moe_backward_op.register_fake
def _(
    grad_y: Tensor, x: Tensor, topk_ids: Tensor, topk_scores: Tensor, weights: list[Tensor], spec: str,
    projections: Tensor | None = None, counts_E: Tensor | None = None,
) -> list[Tensor]:
    return [torch.empty_like(t, memory_format=_CONTIGUOUS) for t in (x, topk_scores, *weights)]


def _setup_context(ctx, inputs, output) -> None:
    x, topk_ids, topk_scores, weights, spec, *_ = inputs
    *_, counts_E = output
    saved = [output[1]] if len(output) == 3 else []  # ring_moe_saving's projections
    ctx.mark_non_differentiable(*saved, counts_E)
    # Else autograd hands the backward zero gradients of them: for the projections, a second (T*K, U) buffer.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, topk_ids, topk_scores, counts_E, *saved, *weights)
    ctx.saves, ctx.spec = bool(saved), spec
    # The backward runs with this very spec, even if the registry evicted or replaced it meanwhile. (While
    # Dynamo traces, the spec's registration is a side effect it applies later: none to hold yet.)
    ctx.spec_state = spec_held(spec)


def _backward(ctx, grad_y: Tensor | None, *_not_differentiable: Tensor | None):
    x, topk_ids, topk_scores, counts_E, *rest = ctx.saved_tensors
    projections, weights = (rest[0], rest[1:]) if ctx.saves else (None, rest)
    if grad_y is None:  # not materialized: y did not reach the loss
        grad_y = torch.zeros_like(x)
    with holding(ctx.spec_state) if ctx.spec_state is not None else contextlib.nullcontext():
        dx, d_scores, *d_weights = torch.ops.relaymoe.ring_moe_backward(
            grad_y, x, topk_ids, topk_scores, list(weights), ctx.spec, projections, counts_E
        )
    return dx, None, d_scores, d_weights, None


ring_moe_op.register_autograd(_backward, setup_context=_setup_context)
ring_moe_saving_op.register_autograd(_backward, setup_context=_setup_context)

@torch.library.custom_op("relaymoe::kept_all_to_all", mutates_args=())
def kept_all_to_all_op(t: Tensor, group_name: str, refused: bool = False) -> Tensor:
    """A copy of ``t``, the input of the first collective of a region that runs its all-to-alls (kept by the
    cost model, or ``refused``), once every rank of the group is known to do the same
    (``agreement.agree_kept``; ``RingInputError`` on every rank if not)."""
    ring = RingGroup.resolve(group_name)
    if ring.size > 1:
        agree_kept(ring, t.device, refused)
    return t.clone()


@kept_all_to_all_op.register_fake
def _(t: Tensor, group_name: str, refused: bool = False) -> Tensor:
    return torch.empty_like(t)


kept_all_to_all_op.register_autograd(lambda ctx, grad: (grad, None, None))

# The ops' overloads: what the rewrite pass inserts into Dynamo graphs.
RING_MOE = torch.ops.relaymoe.ring_moe.default
RING_MOE_SAVING = torch.ops.relaymoe.ring_moe_saving.default
KEPT_ALL_TO_ALL = torch.ops.relaymoe.kept_all_to_all.default

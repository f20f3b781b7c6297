"""``ring_moe``: the functional RelayMoE block, for code that does not go through torch.compile.

    y = ring_moe(x_TH, topk_ids_TK, topk_scores_TK, w1, w2, w3, group=ep_group)

computes the same ``y`` as an all-to-all EP MoE block (``relay_compile.reference.a2a_moe``) without ever
building the top-k-expanded ``[T*K, H]`` buffers: expert partitions (or token partitions) circulate around the
EP group and each hop computes only the pairs that meet there. Differentiable to ``x``, the scores and the
weights through the ``relaymoe`` custom ops, so it composes with torch.compile and aot_autograd.

Legend: T local tokens, H hidden, K top-k, E experts in the group, E_l = E / N local experts, F FFN width.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from relay_compile.experts import ACTIVATIONS, Activation, ExpertFn, ffn_expert_fn
from relay_compile.runtime.agreement import BadArgument, fail_together
from relay_compile.runtime.fn_identity import identify
from relay_compile.runtime.ops import check_routing_args, ring_moe_op, ring_moe_saving_op
from relay_compile.runtime.ring_options import ChunkGraphs, LinkGbps, MaxHopRows, RingOptions, SaveProjections
from relay_compile.runtime.saved_projections import call_saves, can_save
from relay_compile.runtime.specs import SCORES_APPLIED, RingSpec, ScoresApplied, register_spec
from relay_compile.runtime.transport import RingGroup

# Every FFN expert function, made once: building one while torch.compile traces ``ring_moe`` would make
# Dynamo reconstruct a new object (it cannot).
_FFN_FNS: dict[tuple[str, bool | None], ExpertFn] = {
    (activation, grouped): ffn_expert_fn(cast(Activation, activation), grouped) for activation in ACTIVATIONS
    for grouped in (None, True, False)
}


def _group_name(group: dist.ProcessGroup | str | None) -> str:
    """Name of the EP group; ``""`` (a ring of one) when torch.distributed is not initialized.

    Raises ``ValueError`` for ``""`` (it names no group: pass None) and for anything that is not a group or a
    group's name, such as what ``dist.new_group`` returns on ranks outside the new group.
    """
    if isinstance(group, str):
        if not group:
            raise ValueError("ring_moe: group='' names no process group; pass None for the default group")
        return group
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return ""
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"ring_moe: group={group!r} is not a process group (dist.new_group returns "
            "GroupMember.NON_GROUP_MEMBER on ranks outside the new group): call ring_moe only on the group's "
            "ranks, with the group or its name"
        )
    return group.group_name


@contextlib.contextmanager
def _raising_together(group_name: str, x: Tensor) -> Iterator[None]:
    """A check that fails on this rank of a multi-rank group fails on every rank, before any transfer.

    Its peers are already in the op's exchange (``runtime.agreement``): this rank joins it with the problem,
    and every rank raises (this one its own error, the others ``RingInputError`` naming this rank and the
    argument). A ring of one, and a trace under torch.compile, raise at once.
    """
    try:
        yield
    except Exception as e:
        if torch.compiler.is_compiling() or not group_name:
            raise
        ring = RingGroup.resolve(group_name)
        if ring.size == 1:
            raise
        fail_together(ring, e, x.device if isinstance(x, Tensor) else torch.device("cpu"))


def _check_ffn_weights(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None, activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise BadArgument("activation", f"ring_moe: activation={activation!r} is not one of {ACTIVATIONS}")
    if w1.dim() != 3 or w1.shape[2] != x.shape[1]:
        raise BadArgument("w1", f"ring_moe: w1 must be (E_local, F, H={x.shape[1]}), got {tuple(w1.shape)}")
    e_l, f, h = w1.shape
    if tuple(w2.shape) != (e_l, h, f):
        raise BadArgument("w2", f"ring_moe: w2 must be (E_local, H, F) = {(e_l, h, f)}, got {tuple(w2.shape)}")
    if (activation == "swiglu") != (w3 is not None):
        raise BadArgument("w3", f"ring_moe: w3 is needed by swiglu and only by it (activation={activation!r})")
    if w3 is not None and w3.shape != w1.shape:
        raise BadArgument("w3", f"ring_moe: w3 must have w1's shape {tuple(w1.shape)}, got {tuple(w3.shape)}")
    for name, w in (("w1", w1), ("w2", w2), ("w3", w3)):
        if w is not None and (w.dtype != x.dtype or w.device != x.device):
            raise BadArgument(name, (
                f"ring_moe: {name} is {w.dtype} on {w.device} but x is {x.dtype} on {x.device}; they must agree"))


def _check_experts_per_rank(experts_per_rank: int) -> None:
    if experts_per_rank < 1:
        raise BadArgument("experts_per_rank", (
            f"ring_moe: each rank must hold at least one expert, got {experts_per_rank}"))


def _check_scores_applied(scores_applied: object) -> None:
    if scores_applied not in SCORES_APPLIED:
        raise BadArgument("scores_applied", (
            f"ring_moe: scores_applied={scores_applied!r} is not one of {SCORES_APPLIED}"))


def ring_moe_experts(
    x: Tensor,
    topk_ids: Tensor,
    topk_scores: Tensor,
    weights: Sequence[Tensor],
    *,
    expert_fn: ExpertFn,
    experts_per_rank: int,
    group: dist.ProcessGroup | str | None = None,
    routing: str = "auto",
    overlap: bool = True,
    remat: bool = True,
    max_hop_rows: MaxHopRows = "auto",
    fp32_accumulation: bool = True,
    chunk_graphs: ChunkGraphs = False,
    ring: str = "auto",
    fp8: bool = False,
    link_gbps: LinkGbps = "auto",
    name: str | None = None,
    scores_applied: ScoresApplied = "after",
    save_projections: SaveProjections = "auto",
    gather_in_gemm: bool = False,
    add_in_gemm: bool = False,
) -> Tensor:
    """``ring_moe`` with any expert function (``relay_compile.experts`` gives its contract).

    Args:
        weights: this rank's partition, leading dimension ``experts_per_rank`` by convention; every rank
            passes tensors of the same shapes.
        expert_fn: ``F(x_SH, counts_NL, splits_N, weights) -> out_SH``, called per hop (or chunk).
        name: what ``expert_fn`` computes, as a name: every rank passes the same one, and a call with
            another function under the same name replaces it (a closure made at every step). Default: the
            function's code and what it captures (``runtime.fn_identity``), so a new closure over equal
            values is the same expert function, and a different one is told apart. Under torch.compile the
            spec is registered while Dynamo traces: the compiled graph keeps the function it was traced with.
        scores_applied, save_projections, gather_in_gemm, add_in_gemm: see ``ring_moe``.
    """
    group_name = _group_name(group)
    with _raising_together(group_name, x):
        check_routing_args(x, topk_ids, topk_scores)
        _check_experts_per_rank(experts_per_rank)
        _check_scores_applied(scores_applied)
        # (Options are made inside ``_register``: Dynamo runs it as is instead of tracing the dataclass.)
        options = dict(
            routing=routing, overlap=overlap, remat=remat, max_hop_rows=max_hop_rows,
            fp32_accumulation=fp32_accumulation, chunk_graphs=chunk_graphs, ring=ring, fp8=fp8, link_gbps=link_gbps,
            save_projections=save_projections, gather_in_gemm=gather_in_gemm, add_in_gemm=add_in_gemm)
        compiling = torch.compiler.is_compiling()
        key = _register(expert_fn, experts_per_rank, group_name, options, name, scores_applied, compiling)
        saves = (_saves_traced(expert_fn, options, scores_applied, x.device.type) if compiling else
                 call_saves(expert_fn, RingOptions.checked("ring_moe", **options), scores_applied, group_name, x,
                            topk_ids, list(weights), experts_per_rank))
    if saves:
        return ring_moe_saving_op(x, topk_ids, topk_scores, list(weights), key)[0]
    return ring_moe_op(x, topk_ids, topk_scores, list(weights), key)[0]


@torch.compiler.assume_constant_result
def _register(
    expert_fn: ExpertFn, experts_per_rank: int, group_name: str, options: dict[str, Any], name: str | None,
    scores_applied: ScoresApplied, compiling: bool,
) -> str:
    """Register the call's spec; its key.

    While torch.compile traces, Dynamo runs this as it is and keeps the key as a constant of the graph, so the
    spec exists (pinned) before the graph first runs; a registration traced as a side effect would be
    applied only after the graph ran.
    """
    fn_name, identity = (name, name) if name else identify(expert_fn)
    spec = RingSpec(expert_fn=expert_fn, experts_per_rank=experts_per_rank, group_name=group_name,
                    options=RingOptions.checked("ring_moe", **options), scores_applied=scores_applied)
    return register_spec(spec, fn_name, identity=identity, functional=True, pinned=compiling)


@torch.compiler.assume_constant_result
def _saves_traced(expert_fn: ExpertFn, options: dict[str, Any], scores_applied: ScoresApplied, device_type: str
                  ) -> bool:
    """``call_saves`` while torch.compile traces the call (run as is, its result a constant of the graph): only
    where the option says True, since the shapes may be symbolic."""
    return options["save_projections"] is True and can_save(
        expert_fn, RingOptions.checked("ring_moe", **options), scores_applied, torch.device(device_type))


def ring_moe(
    x: Tensor,
    topk_ids: Tensor,
    topk_scores: Tensor,
    w1: Tensor,
    w2: Tensor,
    w3: Tensor | None = None,
    *,
    group: dist.ProcessGroup | str | None = None,
    routing: str = "auto",
    activation: Activation = "swiglu",
    overlap: bool = True,
    remat: bool = True,
    max_hop_rows: MaxHopRows = "auto",
    fp32_accumulation: bool = True,
    chunk_graphs: ChunkGraphs = False,
    ring: str = "auto",
    fp8: bool = False,
    link_gbps: LinkGbps = "auto",
    use_grouped_mm: bool | None = None,
    scores_applied: ScoresApplied = "after",
    save_projections: SaveProjections = "auto",
    gather_in_gemm: bool = False,
    add_in_gemm: bool = False,
) -> Tensor:
    """The RelayMoE block: ``y[t] = sum_k topk_scores[t, k] * FFN_{topk_ids[t, k]}(x[t])``.

    Args:
        x: local tokens ``(T, H)``.
        topk_ids: global expert ids ``(T, K)``; expert ``e`` lives on group rank ``e // E_local``.
        topk_scores: router weights ``(T, K)``.
        w1, w3: this rank's experts ``(E_local, F, H)`` (w3 for swiglu only); w2: ``(E_local, H, F)``.
        group: the EP group (default: the world group; none initialized: a ring of one).
        routing: ``"expert"`` circulates weights, ``"token"`` circulates tokens, ``"auto"`` picks the one
            with less traffic per hop, from shapes only (so every rank agrees).
        overlap: post each hop's transfer before its compute (False: the sequential ring, for ablation).
        remat: backward hops recompute their activations and release them (False: replay the whole block
            first and keep every hop's activations, as whole-block checkpointing would; for ablation).
        max_hop_rows: bound the rows of one expert call; hops with more pairs run in chunks, so peak memory
            stops growing with tokens (None: one call per hop; ``"auto"``, the default: a fraction of this
            rank's tokens, with a floor: ``runtime.ring_options.hop_row_bound``).
        fp32_accumulation: sum what the ring accumulates across hops (weight gradients; token routing's
            travelling outputs and input gradients) in fp32, like the all-to-all layer's fp32-accumulating
            GEMMs; False: in the summands' dtype (in bf16 half the bytes of those transfers, one rounding per hop).
        chunk_graphs: run a hop's chunks at bucketed row counts as CUDA graphs captured once and replayed
            (``runtime.chunk_graphs``): less host work per hop for a host-bound ring, for about one chunk's
            working set held between calls (``relay_compile.runtime.chunk_graphs.held_bytes``, ``clear``) and a
            few percent more GPU work; ``"auto"``: on CUDA. Off by default (docs/BENCHMARKS.md, "Chunk
            graphs"). A per-rank knob: it may differ across ranks.
        ring: ``"auto"`` runs the block as a ring where the cost model predicts it no slower than the
            all-to-all the call would run instead, the op's own path (``runtime.all_to_all``, which recomputes
            its experts in backward: ``cost_model.Calibration.op_a2a_ratio``; on CUDA, else always the ring);
            ``"memory"`` also where it is slower but the all-to-all's predicted peak is higher; ``"always"``;
            ``"never"``: that all-to-all. Decided per call from the shapes every rank agreed on.
        fp8: FP8 hops (``runtime.fp8_experts``): the experts' weights circulate in E4M3 with one scale per
            expert matrix (half the bytes per hop) and the products by the weights run as FP8 grouped GEMMs
            (``torch._scaled_grouped_mm`` on CUDA; an exact fp32 emulation elsewhere); weight gradients and
            sums across hops stay as wide as without it. SwiGLU without biases only (``ValueError``
            otherwise). Off by default; every rank passes the same.
        link_gbps: the link the cost model takes one hop's transfer to cross (the ``ring`` decision): GB/s of
            one direction of the slowest link a hop crosses (an inter-node network's per-GPU bandwidth, ~50, for
            a ring that spans nodes); ``"auto"``: from the group's backend (NCCL: NVLink-class, 450, or 50 where
            the group spans nodes; a group without device links, such as the one-GPU stand-in: device copies).
            The group decides with the slowest link any rank reports.
        use_grouped_mm: ``torch._grouped_mm`` (None: where supported) or a loop over experts.
        scores_applied: ``"after"`` the experts (above), or ``"before"`` them: ``y[t] = sum_k
            FFN_{topk_ids[t, k]}(topk_scores[t, k] * x[t])`` (DeepSpeed, Megatron's ``moe_apply_probs_on_input``).
        save_projections: the expert ring's forward keeps every pair's first projection (``T*K`` rows of
            ``2F``) until the backward, which then does not recompute it per hop (two of the ring's eleven GEMM
            passes). ``"auto"``: where the cost model predicts the ring without them slower than the all-to-all,
            or faster by less than its error (``cost_model.SAVE_MARGIN``), and its peak with them no higher than
            the all-to-all's (CUDA, eager calls); True: wherever the ring
            runs in expert routing (scores after the experts, no chunk graphs or FP8 hops); False: never. A
            per-rank knob: a call saves where every rank's call can.
        gather_in_gemm: a hop's first GEMMs read their rows at the tokens' indices
            (``kernels.gathered_grouped_mm``) instead of gathering them into a buffer first, SwiGLU's forward and
            backward in the first projection's epilogue (CUDA, 16-bit rows; FFN experts without biases; the
            backward's only for SwiGLU experts, whose first GEMMs store the rows for the weight gradients). A
            per-rank knob.
        add_in_gemm: a hop's last GEMMs (the forward's down projection, the backward's ``dx``) add their rows into
            the ring's fp32 sums in their epilogue instead of writing them for a scatter-add (the same experts;
            sums held on the rank). A per-rank knob.

    Returns:
        ``(T, H)`` in ``x``'s dtype.

    Raises:
        ValueError: a bad argument on this rank (names the argument; with a multi-rank group, after the
            other ranks learned of it, so none waits).
        RingInputError: on every rank alike, before any transfer: a bad argument on another rank (names the
            rank and the argument), arguments or options that differ across ranks (names both ranks: shapes,
            dtypes, experts per rank, routing, overlap, remat, fp32_accumulation, the expert function,
            scores_applied; ``max_hop_rows`` may
            differ), or expert ids outside ``[0, E)`` on any rank.
        RingPeerError: another rank failed inside the ring and this rank received data it sent after that
            (``runtime.transport``): at the end of this call where that status is on the CPU, else at the
            group's next call, on every rank. A failure inside a hop raises on its own rank after the ring's
            last transfer, and the group stays usable.
    """
    group_name = _group_name(group)
    with _raising_together(group_name, x):
        check_routing_args(x, topk_ids, topk_scores)
        _check_ffn_weights(x, w1, w2, w3, activation)
        if use_grouped_mm not in (None, True, False):
            raise BadArgument(
                "use_grouped_mm", f"ring_moe: use_grouped_mm must be None or a bool, got {use_grouped_mm!r}")
    fn = _FFN_FNS[(activation, use_grouped_mm)]
    weights = [w1, w2] if w3 is None else [w1, w2, w3]
    return ring_moe_experts(
        # The name ("" only without torch.distributed: a ring of one, which None says again).
        x, topk_ids, topk_scores, weights, expert_fn=fn, experts_per_rank=w1.shape[0], group=group_name or None,
        routing=routing, overlap=overlap, remat=remat, max_hop_rows=max_hop_rows,
        fp32_accumulation=fp32_accumulation, chunk_graphs=chunk_graphs, ring=ring, fp8=fp8,
        link_gbps=link_gbps,
        name=f"ffn[{activation},grouped_mm={use_grouped_mm}]",
        scores_applied=scores_applied, save_projections=save_projections, gather_in_gemm=gather_in_gemm,
        add_in_gemm=add_in_gemm,
    )

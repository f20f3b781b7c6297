"""Which ring calls save the expert ring's first projections for its backward (option ``save_projections``).

The backward of an expert ring recomputes, per hop, every pair's first projection ``h = x @ w13`` (``2F``
columns for SwiGLU): 2 of the ring's 11 GEMM passes over its rows (the all-to-all runs 9), part of what keeps
the ring above the all-to-all's time at 4k-16k tokens per rank. Saving ``h`` in the forward (``T*K`` rows, in
sorted-pair order) lets the backward read it instead (``ops.ring_moe_saving``), for that memory held from
forward to backward.

The op's outputs have static shapes, so whether a call *can* save is decided before the op runs (``saving_op``:
by ``ring_moe`` per call, by the rewrite pass per region at compile time). The op then claims it in the
agreement (``Claims.saves``), and the call saves wherever every rank's op is a saving one and the expert ring
runs: each rank decided already (its buffer is allocated), so the group does not decide again from its largest
token count. The same decision in forward and backward.

Legend: T tokens, K top-k, F expert width, U the first projection's width (2F gated, F otherwise).
"""

from __future__ import annotations

from typing import Literal

import torch

from relay_compile.experts import ExpertFn, as_grouped
from relay_compile.runtime.block_shape import BlockShape, OwnerOptions, owner_options
from relay_compile.runtime.cost_model import CALIBRATED_DEVICES, Calibration, calibration_for, choose
from relay_compile.runtime.ring_options import RingOptions
from relay_compile.runtime.transport import RingGroup, link_gbps


def can_save(expert_fn: ExpertFn, options: RingOptions, scores_applied: Literal["after", "before"],
             device: torch.device) -> bool:
    """Whether the expert ring of these can save: grouped experts whose fused backward takes saved projections
    (``projection_dtype``), scores after the experts, no chunk graphs and no FP8 hops (their expert functions
    are others), hop-scoped remat (without it the backward replays the block by autograd and reads none), and the
    option not False. Before the op (``saving_op``) and in it (``ops._prepare``: what a rank claims)."""
    grouped = as_grouped(expert_fn)
    return (options.save_projections is not False and options.remat and grouped is not None
            and grouped.has_fused_backward and hasattr(grouped, "projection_dtype")
            and scores_applied == "after" and not options.graphs_on(device) and not options.fp8)


def saving_op(
    expert_fn: ExpertFn, options: RingOptions, scores_applied: Literal["after", "before"], device: torch.device,
    shape: BlockShape | None, cal: Calibration | None, owners: tuple[int, int] | OwnerOptions = (1, 1),
) -> bool:
    """Whether a call of these runs as ``ring_moe_saving`` (else the plain ``ring_moe`` op).

    ``shape``: the block's sizes on this rank (None: not static, as a dynamic token count at compile time);
    ``cal``: the device's time model; ``owners``: the expert ring's owners per forward / backward hop, or the
    rules' and larger stacks (``cost_model.OwnerOptions``, as ``choose`` takes them). Under
    ``"auto"`` only where ``cost_model.choose`` would save at ``shape`` (a calibrated device, static sizes);
    under True wherever ``can_save``.
    """
    if not can_save(expert_fn, options, scores_applied, device):
        return False
    if options.save_projections is True:
        return True
    if shape is None or cal is None or device.type not in CALIBRATED_DEVICES:
        return False
    return choose(shape, routing=options.routing, ring=options.ring, cal=cal, owners=owners,
                  max_hop_rows=options.max_hop_rows, saving=1, kept="op").saves  # as the op's call decides


def compile_time_level(options: RingOptions, scores_applied: Literal["after", "before"], device: torch.device,
                       grouped: bool) -> int:
    """``Claims.saves`` as a decision made before the expert function is chosen predicts it (the compile-time
    keep, the report): the option's code where F lowers onto grouped experts (``grouped``: the lowered FFN can
    save where its activation has a fused backward) and nothing else rules saving out, else 0."""
    possible = (grouped and options.remat and scores_applied == "after" and not options.graphs_on(device)
                and not options.fp8)
    return options.saves_code if possible else 0


def call_saves(
    expert_fn: ExpertFn, options: RingOptions, scores_applied: Literal["after", "before"], group_name: str,
    x: torch.Tensor, topk_ids: torch.Tensor, weights: list[torch.Tensor], experts_per_rank: int,
) -> bool:
    """``saving_op`` for one eager call of ``ring_moe``: this rank's shapes, the tokens' device's time model
    (their ``BlockShape`` made only where ``"auto"`` asks the model)."""
    if options.save_projections != "auto" or x.device.type not in CALIBRATED_DEVICES:
        return saving_op(expert_fn, options, scores_applied, x.device, None, None)
    ring = RingGroup.resolve(group_name)
    matrices = [w.shape for w in weights if w.dim() == 3]
    params = sum(w.numel() for w in weights if w.dim() == 3) // max(1, experts_per_rank)  # matrices: no biases
    shape = BlockShape(
        tokens=x.shape[0], hidden=x.shape[1], ffn=min(min(m[1], m[2]) for m in matrices), top_k=topk_ids.shape[1],
        experts_per_rank=experts_per_rank, group_size=ring.size, elem_bytes=x.element_size(),
        expert_bytes=sum(w.numel() * w.element_size() for w in weights) // max(1, experts_per_rank),
        expert_params=params)
    cal = calibration_for(x.device).with_link(link_gbps(ring.group, options.link_gbps))
    return saving_op(expert_fn, options, scores_applied, x.device, shape, cal, owner_options(shape))

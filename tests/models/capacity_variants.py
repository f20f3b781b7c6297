"""Variants of the DeepSpeed-style capacity layer that the matcher must leave unchanged, with a reason.

Each changes one thing of ``tests.models.deepspeed_style.DeepSpeedStyleMoE``; everything else is the matched
pattern. (Experts with biases, ``DeepSpeedStyleMoE(..., bias=True)``, are matched and lowered with them.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from tests.models.deepspeed_style import DeepSpeedStyleMoE, Experts


class ScoresBeforeExperts(DeepSpeedStyleMoE):
    """The capacity buffers hold tokens scaled by their combine weights (F is not linear: another function)."""

    def dispatch(self, dispatch_mask: Tensor, combine_weights: Tensor, reshaped_input: Tensor) -> Tensor:
        return torch.einsum("sec,sm->ecm", combine_weights.type_as(reshaped_input), reshaped_input)


class BatchedMatmulDispatch(DeepSpeedStyleMoE):
    """The capacity buffers as one batched matmul of the permuted mask: ``(E, C, S) @ (S, M)``."""

    def dispatch(self, dispatch_mask: Tensor, combine_weights: Tensor, reshaped_input: Tensor) -> Tensor:
        return torch.matmul(dispatch_mask.to(reshaped_input.dtype).permute(1, 2, 0), reshaped_input)


class SlotMixingExperts(Experts):
    """Experts that subtract the mean over their capacity slots: a row's result depends on the other tokens."""

    def forward(self, inputs: Tensor) -> Tensor:
        out = super().forward(inputs)
        return out - out.mean(dim=2, keepdim=True)


class SourceChunkExperts(Experts):
    """Experts on chunks of the sources' dimension (dim 0 of (N, E_l, C, M)), not of the local experts': with
    N == E_l the same shapes as DeepSpeed's, another function (expert e gets source e's rows of every expert)."""

    def forward(self, inputs: Tensor) -> Tensor:
        chunks = inputs.chunk(self.num_local_experts, dim=0)
        return torch.cat([expert(chunk) for chunk, expert in zip(chunks, self.deepspeed_experts)], dim=0)


def with_experts(moe: DeepSpeedStyleMoE, experts: type[Experts]) -> DeepSpeedStyleMoE:
    """``moe`` with its ``Experts`` replaced by ``experts`` over the same expert modules."""
    moe.experts = experts(list(moe.experts.deepspeed_experts))
    return moe

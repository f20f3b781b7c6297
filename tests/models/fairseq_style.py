"""A fairseq-style capacity MoE layer: the DeepSpeed-style layer with fairseq ``MOELayer``'s mm dispatch/combine.

fairseq (``fairseq/modules/moe/moe_layer.py``) writes GShard's two einsums as matrix products:

    dispatch_mask = dispatch_mask.to(input.dtype).permute(1, 2, 0)          # (E, C, S)
    dispatched_input = torch.mm(dispatch_mask.view(E * C, S), reshaped_input)   # (E * C, M)
    ...
    combined_output = combine_weights.view(S, E * C).mm(expert_output.view(E * C, M))

Gate and experts are ``tests.models.deepspeed_style``'s (fairseq's top-2 gating is the same algorithm).

Legend: S tokens, M model dim, E experts, C capacity.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tests.models.deepspeed_style import DeepSpeedStyleMoE


class FairseqStyleMoE(DeepSpeedStyleMoE):
    def dispatch(self, dispatch_mask: Tensor, combine_weights: Tensor, reshaped_input: Tensor) -> Tensor:
        dispatch_mask = dispatch_mask.to(reshaped_input.dtype).permute(1, 2, 0)  # S,E,C -> E,C,S
        E, C, S = dispatch_mask.size()
        return torch.mm(dispatch_mask.reshape(E * C, S), reshaped_input)  # -> (E*C),M

    def combine(self, combine_weights: Tensor, expert_output: Tensor) -> Tensor:
        S, E, C = combine_weights.shape
        return combine_weights.view(S, E * C).mm(expert_output.reshape(E * C, -1))

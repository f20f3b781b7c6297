"""Idiom layers whose experts are not an FFN the grouped experts run: each expert normalizes its rows first
(a per-expert LayerNorm), then ``fc1`` with a bias, a quick-GELU (``h * sigmoid(1.702 h)``) and ``fc2``.

``expert_block`` refuses such an F (the LayerNorm, the activation), so the backend compiles F by
its inner compiler (``relay_compile/runtime/compiled_experts.py``). Two dispatchers: the data-dependent one (rows regrouped
with repeat_interleave, boolean masks and nonzero inside F; splits per source) and the scores-first one
(splits per (source, expert), scores on the dispatched rows: the ring differentiates F with autograd).

Legend: H hidden, F expert FFN width, E_l local experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as nnf
from torch import Tensor, nn

from tests.models.data_dependent import DataDependentMoE
from tests.models.scores_first import ScoresFirstMoE


class _NormedExperts:
    """Replaces ``EPLayer.expert`` (mixed in before an ``EPLayer``): LayerNorm ``(E_l, H)``, ``fc1`` bias
    ``(E_l, F)``, quick-GELU. ``w3`` is left unused (it gets no gradient)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        El, (F, H) = self.num_local_experts, self.w1.shape[1:]
        g = torch.Generator().manual_seed(7)
        self.norm_weight = nn.Parameter(1 + 0.1 * torch.randn(El, H, generator=g))
        self.norm_bias = nn.Parameter(0.1 * torch.randn(El, H, generator=g))
        self.b1 = nn.Parameter(0.1 * torch.randn(El, F, generator=g))
        del self.w3

    def expert(self, e: int, x_CH: Tensor) -> Tensor:
        h_CH = nnf.layer_norm(x_CH, x_CH.shape[-1:], self.norm_weight[e], self.norm_bias[e])
        h_CF = nnf.linear(h_CH, self.w1[e], self.b1[e])
        return (h_CF * torch.sigmoid(1.702 * h_CF)) @ self.w2[e].T


class NormedDataDependentMoE(_NormedExperts, DataDependentMoE):
    """``DataDependentMoE`` with normed experts."""


class NormedScoresFirstMoE(_NormedExperts, ScoresFirstMoE):
    """``ScoresFirstMoE`` with normed experts."""

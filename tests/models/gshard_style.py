"""A GShard/Tutel-style expert-parallel MoE layer: top-k capacity gating, einsum dispatch, batched experts.

Written the way GShard's reference (lingvo's ``top2_gating``), fairscale's ``Top2Gate`` and Tutel's legacy
batched experts write it, on CPU/gloo:

    gate        softmax(wg(x)); topk(gates, k); per choice i a one-hot mask (S, E)
    locations   cumsum(mask_i, dim=0) - 1 + tokens of earlier choices: each token's slot; dropped if >= C
    combine     combine_weights = sum_i gate_i[:, None, None] * mask_i[:, :, None] * one_hot(slot_i, C)[:, None, :]
                dispatch_mask = combine_weights > 0
    dispatch    einsum("sm,sec->ecm", x, dispatch_mask) -> (E, C, M); equal-split all_to_all_single
    experts     (N, E_l, C, M) -> (E_l, N * C, M); einsum("ecm,emf->ecf", x, w1); relu; bmm with w2 (E_l, F, M);
                back to (N, E_l, C, M)
    combine     all_to_all_single back; (E, C, M); einsum("sec,ecm->sm", combine_weights, out)

With ``bias``, the experts add Tutel's biases: ``batched_fc1_bias`` stored ``(E_l, 1, F)`` and added as it is,
``batched_fc2_bias`` stored ``(E_l, M)`` and broadcast over the slots as ``[:, None, :]``.

Legend: S tokens (per rank), M model dim, E experts, E_l local experts, C capacity, N ranks, F expert width.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as nnf
from torch import Tensor, nn


def topk_capacity_gating(logits_SE: Tensor, k: int, capacity_factor: float) -> tuple[Tensor, Tensor]:
    """``(combine_weights_SEC, dispatch_mask_SEC)`` of GShard's top-k gating with capacity ``C``."""
    gates_SE = nnf.softmax(logits_SE, dim=-1)
    num_tokens, num_experts = gates_SE.shape
    capacity = int(capacity_factor * math.ceil(num_tokens * k / num_experts))
    topk_indices = torch.topk(gates_SE, k, dim=1).indices
    masks = [nnf.one_hot(topk_indices[:, i], num_classes=num_experts) for i in range(k)]
    # Top-2 and up normalize the chosen gates (GShard); top-1 keeps the probability (Switch, fairseq top1gating).
    denom_s = sum((gates_SE * mask).sum(dim=1) for mask in masks) if k > 1 else torch.ones_like(gates_SE[:, 0])
    filled = torch.zeros(1, num_experts, dtype=torch.int64, device=logits_SE.device)
    combine_weights = torch.zeros(num_tokens, num_experts, capacity, device=logits_SE.device)
    for mask in masks:
        locations = torch.cumsum(mask, dim=0) - 1 + filled
        filled = filled + mask.sum(dim=0, keepdim=True)
        mask = mask * torch.lt(locations, capacity)
        locations_s = (locations * mask).sum(dim=1)
        gate_s = (gates_SE * mask).sum(dim=1) / denom_s.clamp(min=torch.finfo(gates_SE.dtype).eps)
        location_sc = nnf.one_hot(locations_s, num_classes=capacity).to(gates_SE.dtype)
        combine_weights = combine_weights + gate_s[:, None, None] * mask[:, :, None] * location_sc[:, None, :]
    return combine_weights, combine_weights > 0


class GShardStyleMoE(nn.Module):
    """Top-k capacity gating + batched experts over the EP ``group``; ``forward(x) -> y``.

    Args:
        dim, hidden, num_experts, top_k: M, F, E, k.
        capacity_factor: C = capacity_factor * ceil(S * k / E).
        group: the EP group (N ranks); rank r owns experts [r * E_l, (r + 1) * E_l).
        seed: the router and all E experts' weights are drawn from it, identically on every rank.
        bias: the experts add biases (Tutel's ``batched_fc1_bias``, ``batched_fc2_bias``).
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, group: dist.ProcessGroup, *,
                 capacity_factor: float = 1.0, seed: int = 0, bias: bool = False) -> None:
        super().__init__()
        self.group, self.world = group, dist.get_world_size(group)
        self.num_local_experts = num_experts // self.world
        self.top_k, self.capacity_factor = top_k, capacity_factor
        state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.wg = nn.Linear(dim, num_experts, bias=False)
        w1 = torch.randn(num_experts, dim, hidden) / dim ** 0.5
        w2 = torch.randn(num_experts, hidden, dim) / hidden ** 0.5
        b1, b2 = 0.1 * torch.randn(num_experts, 1, hidden), 0.1 * torch.randn(num_experts, dim)
        torch.random.set_rng_state(state)
        lo = dist.get_rank(group) * self.num_local_experts
        self.batched_fc1_w = nn.Parameter(w1[lo:lo + self.num_local_experts].clone())
        self.batched_fc2_w = nn.Parameter(w2[lo:lo + self.num_local_experts].clone())
        self.bias = bias
        if bias:
            self.batched_fc1_bias = nn.Parameter(b1[lo:lo + self.num_local_experts].clone())
            self.batched_fc2_bias = nn.Parameter(b2[lo:lo + self.num_local_experts].clone())

    def experts(self, x_NLCM: Tensor) -> Tensor:
        """The local experts on their capacity buffers, batched: ``(N, E_l, C, M) -> (N, E_l, C, M)``."""
        n, e_l, c, m = x_NLCM.shape
        x_LRM = x_NLCM.transpose(0, 1).reshape(e_l, n * c, m)
        h_LRF = torch.einsum("ecm,emf->ecf", x_LRM, self.batched_fc1_w)
        if self.bias:
            h_LRF = h_LRF + self.batched_fc1_bias
        y_LRM = torch.bmm(torch.relu(h_LRF), self.batched_fc2_w)
        if self.bias:
            y_LRM = y_LRM + self.batched_fc2_bias[:, None, :]
        return y_LRM.reshape(e_l, n, c, m).transpose(0, 1).contiguous()

    def forward(self, x_SM: Tensor) -> Tensor:
        d_model = x_SM.shape[-1]
        combine_weights, dispatch_mask = topk_capacity_gating(self.wg(x_SM), self.top_k, self.capacity_factor)
        dispatched = torch.einsum("sm,sec->ecm", x_SM, dispatch_mask.to(x_SM.dtype))
        dispatched = funcol.all_to_all_single_autograd(dispatched, None, None, self.group)
        expert_out = self.experts(dispatched.reshape(self.world, self.num_local_experts, -1, d_model))
        expert_out = funcol.all_to_all_single_autograd(expert_out, None, None, self.group)
        expert_out = expert_out.reshape(self.world * self.num_local_experts, -1, d_model)
        return torch.einsum("sec,ecm->sm", combine_weights, expert_out)

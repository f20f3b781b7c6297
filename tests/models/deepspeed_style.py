"""A DeepSpeed-style expert-parallel MoE layer with capacity-based dispatch (``deepspeed/moe/sharded_moe.py``).

Written the way DeepSpeed's ``TopKGate`` (``top2gating``) + ``MOELayer`` + ``Experts`` write it (GShard's
algorithm, by way of fairscale), on CPU/gloo:

    gate        softmax(wg(x)); 1st expert = argmax, 2nd = argmax of the rest; one-hot masks (S, E)
    locations   cumsum(mask, dim=0) - 1: each token's slot in its expert's capacity buffer
    capacity    C = ceil(S / E * capacity_factor * 2); tokens whose slot is >= C are dropped
    combine     combine_weights[s, e, c] = normalized gate * one_hot(slot, C)     (S, E, C)
                dispatch_mask = combine_weights.bool()
    dispatch    einsum("sec,sm->ecm", dispatch_mask, x) -> (E, C, M); equal-split all_to_all_single
    experts     reshape (N, E_l, C, M); chunk over local experts; a ModuleList of MLPs; cat
    combine     all_to_all_single back; reshape (E, C, M); einsum("sec,ecm->sm", combine_weights, out)

DeepSpeed's ``_capacity`` computes C with tensors and a Python ``if`` on one (a graph break under Dynamo): this
layer computes it in Python, as ports of it do. Its ``_AllToAll`` autograd.Function is the functional
``all_to_all_single_autograd`` by default (same data movement), or that Function (``autograd_function=True``). Experts own their weights: every rank builds all E from one
seed and keeps its own, so ranks agree on the router.

Legend: S tokens (per rank), M model dim, E experts, E_l local experts, C capacity, N ranks, F expert width.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as nnf
from torch import Tensor, nn

from tests.models import autograd_a2a


def _one_hot_to_float(x: Tensor, num_classes: int) -> Tensor:
    return nnf.one_hot(x, num_classes=num_classes).float()


def top2gating(logits_SE: Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: dist.ProcessGroup | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """DeepSpeed's ``top2gating`` (no 2nd-expert sampling): ``(l_aux, combine_weights_SEC, dispatch_mask_SEC)``.

    ``drop_tokens=False``: C is the largest expert load of any rank, agreed by an all-reduce (nothing dropped).
    """
    gates_SE = nnf.softmax(logits_SE, dim=1)
    indices1_s = torch.argmax(gates_SE, dim=1)
    num_experts = int(gates_SE.shape[1])
    mask1 = nnf.one_hot(indices1_s, num_classes=num_experts)
    logits_except1 = logits_SE.masked_fill(mask1.bool(), float("-inf"))
    indices2_s = torch.argmax(logits_except1, dim=1)
    mask2 = nnf.one_hot(indices2_s, num_classes=num_experts)

    # Compute locations in capacity buffer
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1
    # Update 2nd's location by accounting for locations of 1st
    locations2 += torch.sum(mask1, dim=0, keepdim=True)

    me = torch.mean(gates_SE, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts

    if drop_tokens:
        # Remove locations outside capacity from mask
        capacity = max(math.ceil(gates_SE.shape[0] / num_experts * capacity_factor * 2), min_capacity)
        mask1 *= torch.lt(locations1, capacity)
        mask2 *= torch.lt(locations2, capacity)
    else:
        # Do not drop tokens - set capacity according to current expert assignments
        exp_counts = torch.sum(mask1 + mask2, dim=0).detach()
        new_capacity = torch.max(exp_counts)
        dist.all_reduce(new_capacity, op=dist.ReduceOp.MAX, group=ep_group)
        capacity = int(new_capacity)  # NOTE: device-to-host sync

    # Store the capacity location for each token
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)

    # Normalize gate probabilities
    mask1_float = mask1.float()
    mask2_float = mask2.float()
    gates1_s = torch.einsum("se,se->s", gates_SE, mask1_float)
    gates2_s = torch.einsum("se,se->s", gates_SE, mask2_float)
    denom_s = gates1_s + gates2_s
    denom_s = torch.clamp(denom_s, min=torch.finfo(denom_s.dtype).eps)
    gates1_s /= denom_s
    gates2_s /= denom_s

    # Calculate combine_weights and dispatch_mask
    gates1 = torch.einsum("s,se->se", gates1_s, mask1_float)
    gates2 = torch.einsum("s,se->se", gates2_s, mask2_float)
    locations1_sc = _one_hot_to_float(locations1_s, capacity)
    locations2_sc = _one_hot_to_float(locations2_s, capacity)
    combine1_sec = torch.einsum("se,sc->sec", gates1, locations1_sc)
    combine2_sec = torch.einsum("se,sc->sec", gates2, locations2_sc)
    combine_weights = combine1_sec + combine2_sec
    dispatch_mask = combine_weights.bool()
    return l_aux, combine_weights, dispatch_mask


class TopKGate(nn.Module):
    def __init__(self, model_dim: int, num_experts: int, capacity_factor: float, min_capacity: int,
                 drop_tokens: bool = True, ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.capacity_factor, self.min_capacity = capacity_factor, min_capacity
        self.drop_tokens, self.ep_group = drop_tokens, ep_group

    def forward(self, input_SM: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        logits = self.wg(input_SM.float())
        return top2gating(logits, self.capacity_factor, self.min_capacity, self.drop_tokens, self.ep_group)


class MLP(nn.Module):
    """One expert: Linear -> GELU -> Linear (with ``bias``, recognized with its biases)."""

    def __init__(self, model_dim: int, hidden: int, bias: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(model_dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, model_dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(nnf.gelu(self.fc1(x)))


class Experts(nn.Module):
    """DeepSpeed's ``Experts``: chunk the (N, E_l, C, M) input over local experts, one module each, cat."""

    def __init__(self, experts: list[nn.Module]) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(experts)
        self.num_local_experts = len(experts)

    def forward(self, inputs: Tensor) -> Tensor:
        chunks = inputs.chunk(self.num_local_experts, dim=1)
        expert_outputs = []
        for chunk, expert in zip(chunks, self.deepspeed_experts):
            out = expert(chunk)
            if isinstance(out, tuple):
                out = out[0]
            expert_outputs += [out]
        return torch.cat(expert_outputs, dim=1)


class DeepSpeedStyleMoE(nn.Module):
    """``MOELayer(TopKGate, Experts)`` over the EP ``group``; ``forward(x) -> (y, l_aux)``.

    Args:
        dim, hidden, num_experts: M, F, E.
        capacity_factor: DeepSpeed's; C = ceil(S / E * capacity_factor * 2) (top-2), at least ``min_capacity``.
        drop_tokens: False: C = the largest expert load over the ranks (an all-reduce), nothing dropped.
        group: the EP group (N ranks); rank r owns experts [r * E_l, (r + 1) * E_l).
        seed: the router and all E experts are drawn from it, identically on every rank.
        bias: experts' Linear layers with biases.
        autograd_function: the all-to-alls through DeepSpeed's ``_AllToAll`` autograd.Function (an in-place
            ``dist.all_to_all_single`` in forward, the reverse in backward) instead of the functional one.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, group: dist.ProcessGroup, *,
                 capacity_factor: float = 1.0, min_capacity: int = 1, drop_tokens: bool = True, seed: int = 0,
                 bias: bool = False, autograd_function: bool = False) -> None:
        super().__init__()
        self.ep_group, self.ep_size = group, dist.get_world_size(group)
        self.num_local_experts = num_experts // self.ep_size
        state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.gate = TopKGate(dim, num_experts, capacity_factor, min_capacity, drop_tokens, group)
        experts = [MLP(dim, hidden, bias) for _ in range(num_experts)]
        torch.random.set_rng_state(state)
        lo = dist.get_rank(group) * self.num_local_experts
        self.experts = Experts(experts[lo:lo + self.num_local_experts])
        self.autograd_function = autograd_function

    def all_to_all(self, t: Tensor) -> Tensor:
        """The equal-split all-to-all of MOELayer (``_AllToAll.apply(self.ep_group, t)`` in DeepSpeed)."""
        if self.autograd_function:
            return autograd_a2a.all_to_all(self.ep_group, t)
        return funcol.all_to_all_single_autograd(t, None, None, self.ep_group)

    def dispatch(self, dispatch_mask: Tensor, combine_weights: Tensor, reshaped_input: Tensor) -> Tensor:
        """Every expert's capacity buffer ``(E, C, M)`` (tests.models.capacity_variants overrides it)."""
        return torch.einsum("sec,sm->ecm", dispatch_mask.type_as(reshaped_input), reshaped_input)

    def combine(self, combine_weights: Tensor, expert_output: Tensor) -> Tensor:
        """The tokens' outputs ``(S, M)`` from every expert's ``(E, C, M)`` (tests.models.fairseq_style: mm)."""
        return torch.einsum("sec,ecm->sm", combine_weights, expert_output)

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
        d_model = hidden_states.shape[-1]
        reshaped_input = hidden_states.reshape(-1, d_model)
        l_aux, combine_weights, dispatch_mask = self.gate(reshaped_input)
        dispatched_input = self.dispatch(dispatch_mask, combine_weights, reshaped_input)
        dispatched_input = self.all_to_all(dispatched_input)
        # Re-shape after all-to-all: ecm -> gecm
        dispatched_input = dispatched_input.reshape(self.ep_size, self.num_local_experts, -1, d_model)
        expert_output = self.experts(dispatched_input)
        expert_output = self.all_to_all(expert_output)
        # Re-shape back: gecm -> ecm
        expert_output = expert_output.reshape(self.ep_size * self.num_local_experts, -1, d_model)
        combined_output = self.combine(combine_weights.type_as(hidden_states), expert_output)
        return combined_output.reshape(hidden_states.shape), l_aux

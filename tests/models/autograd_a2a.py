"""An expert-parallel MoE layer whose all-to-alls live in a user ``torch.autograd.Function`` (issue 11, idiom 4).

Megatron-LM's ``_AllToAll`` (megatron/core/tensor_parallel/mappings.py; DeepSpeed's in deepspeed/moe/
sharded_moe.py has the same shape): an in-place ``dist.all_to_all_single(output, input, output_split_sizes,
input_split_sizes)`` into a fresh buffer in ``forward``, the reverse all-to-all in ``backward``. Dynamo traces
each ``apply`` that needs a gradient into an ``autograd_function_apply`` higher-order op whose forward and
backward bodies hold the collectives; the counts (no gradient) run the forward inline, as
``buffer.copy_(wait(all_to_all_single(...)))``.

    router      softmax (fp32) -> topk                                               scores_TK, ids_TK
    counts      tokens per expert (int64); all_to_all(group, counts) -> per (source, local expert)
    permute     argsort(ids.view(-1), stable) -> order; x.index_select(0, order // K)
    dispatch    all_to_all(group, permuted, output_splits, input_splits)                 _AllToAll.apply
    experts     a loop over (source, local expert) chunks of the received rows: SwiGLU
    combine     all_to_all(group, out, input_splits, output_splits); zeros_like(x).index_add_(0, order // K,
                back * scores.view(-1)[order].unsqueeze(-1))

Legend: T tokens, H hidden, E experts, E_l local experts, K top-k, N ranks, R received rows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from tests.models.ep_layer import EPLayer


class _AllToAll(torch.autograd.Function):
    """Megatron's all-to-all with autograd: the reverse all-to-all in backward."""

    @staticmethod
    def forward(ctx: Any, group: dist.ProcessGroup, input: Tensor, output_split_sizes: list[int] | None,
                input_split_sizes: list[int] | None) -> Tensor:
        ctx.group = group
        ctx.output_split_sizes = output_split_sizes
        ctx.input_split_sizes = input_split_sizes
        world_size = torch.distributed.get_world_size(group=group)
        # Bypass the function if we are using only 1 GPU.
        if world_size == 1:
            return input
        input = input.contiguous()
        if output_split_sizes is None:
            # Equal split (all2all)
            output = torch.empty_like(input)
        else:
            # Unequal split (all2all-v)
            output = input.new_empty(size=[sum(output_split_sizes)] + list(input.size()[1:]), dtype=input.dtype)
        torch.distributed.all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                                            input_split_sizes=input_split_sizes, group=group)
        return output

    @staticmethod
    def backward(ctx: Any, *grad_output: Tensor) -> tuple[Tensor | None, ...]:
        return (None, _AllToAll.apply(ctx.group, *grad_output, ctx.input_split_sizes, ctx.output_split_sizes),
                None, None)


def all_to_all(group: dist.ProcessGroup, input_: Tensor, output_split_sizes_: list[int] | None = None,
               input_split_sizes: list[int] | None = None) -> Tensor:
    """Megatron's ``tensor_parallel.all_to_all``."""
    return _AllToAll.apply(group, input_, output_split_sizes_, input_split_sizes)


class AutogradAllToAllMoE(EPLayer):
    """EP MoE whose all-to-alls are Megatron's ``_AllToAll.apply`` (arguments: ``EPLayer``)."""

    def experts(self, rows_RH: Tensor, chunk_sizes: list[int]) -> Tensor:
        """Received rows, chunked per (source, local expert) -> SwiGLU of each chunk's expert, same order."""
        return torch.cat([self.expert(i % self.num_local_experts, x_CH)
                          for i, x_CH in enumerate(torch.split(rows_RH, chunk_sizes))])

    def forward(self, x_TH: Tensor) -> Tensor:
        N, E, El, K = self.ep_size, self.num_experts, self.num_local_experts, self.top_k
        probs_TE = torch.softmax(self.router(x_TH).float(), dim=-1)
        scores_TK, ids_TK = torch.topk(probs_TE, K, dim=-1)
        num_local_tokens_per_expert = torch.zeros(E, dtype=torch.int64, device=x_TH.device).scatter_add(
            0, ids_TK.view(-1), torch.ones_like(ids_TK.view(-1)))
        num_global_tokens_per_local_expert = all_to_all(self.group, num_local_tokens_per_expert)
        # NOTE: device-to-host sync (split sizes become unbacked SymInts under Dynamo).
        input_splits = num_local_tokens_per_expert.view(N, El).sum(dim=1).tolist()
        output_splits = num_global_tokens_per_local_expert.view(N, El).sum(dim=1).tolist()
        chunk_sizes = num_global_tokens_per_local_expert.tolist()

        order = torch.argsort(ids_TK.view(-1), stable=True)
        permuted_tokens = x_TH.index_select(0, order // K)
        global_input_tokens = all_to_all(self.group, permuted_tokens, output_splits, input_splits)
        expert_output = self.experts(global_input_tokens, chunk_sizes)
        permuted_output = all_to_all(self.group, expert_output, input_splits, output_splits)
        weighted = permuted_output * scores_TK.view(-1)[order].unsqueeze(-1).to(permuted_output.dtype)
        return torch.zeros_like(x_TH).index_add_(0, order // K, weighted)

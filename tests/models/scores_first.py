"""An expert-parallel MoE layer that applies the router scores before the experts (issue 11, idiom 3).

Written the way torchtitan's ``MoE(score_before_experts=True)`` (before 0.3) with its ``ExpertParallel``
all-to-alls writes it (DeepSpeed and Megatron's ``moe_apply_probs_on_input`` compute the same function):

    router      softmax (fp32) -> topk                                               scores_TK, ids_TK
    counts      tokens per expert (int64), all-to-all -> (N * E_l,); split sizes by .tolist()
    reorder     argsort(ids.view(-1), stable) -> order; x[order // K]
    scale       (rows.float() * scores.view(-1)[order].reshape(-1, 1)).to(x.dtype)       scores BEFORE F
    dispatch    all_to_all_single
    experts     a loop over (source, local expert) chunks of the received rows: SwiGLU
    combine     all_to_all_single back; zeros(T, H).scatter_add(0, (order // K).reshape(-1, 1).expand(-1, H), rows)

y[t] = sum_k FFN_{ids[t, k]}(scores[t, k] * x[t]): not the reference layer's function (F is not linear).

Legend: T tokens, H hidden, F expert width, E experts, E_l local experts, K top-k, N ranks, R received rows.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from tests.models.ep_layer import EPLayer


class ScoresFirstMoE(EPLayer):
    """EP MoE whose dispatched rows are ``x[t] * score`` and whose combine is an unweighted scatter-add
    (arguments: ``EPLayer``)."""

    def experts(self, rows_RH: Tensor, chunk_sizes: list[int]) -> Tensor:
        """Received rows, chunked per (source, local expert) -> SwiGLU of each chunk's expert, same order."""
        El = self.num_local_experts
        outs = []
        for i, x_CH in enumerate(torch.split(rows_RH, chunk_sizes)):
            e = i % El
            outs.append(self.expert(e, x_CH))
        return torch.cat(outs)

    def forward(self, x_TH: Tensor) -> Tensor:
        N, E, K = self.ep_size, self.num_experts, self.top_k
        scores_TE = torch.softmax(self.router(x_TH).float(), dim=-1)
        top_scores_TK, selected_experts_TK = torch.topk(scores_TE, K, dim=-1)
        num_tokens_per_expert_E = torch.zeros(E, dtype=torch.int64, device=x_TH.device).scatter_add(
            0, selected_experts_TK.view(-1), torch.ones_like(selected_experts_TK.view(-1)))
        num_tokens_per_expert_group = funcol.all_to_all_single(num_tokens_per_expert_E, None, None, self.group)
        # NOTE: device-to-host sync (split sizes become unbacked SymInts under Dynamo).
        input_splits = num_tokens_per_expert_E.view(N, -1).sum(dim=1).tolist()
        output_splits = num_tokens_per_expert_group.view(N, -1).sum(dim=1).tolist()
        chunk_sizes = num_tokens_per_expert_group.tolist()

        token_indices_experts_sorted = torch.argsort(selected_experts_TK.view(-1), stable=True)
        top_scores_experts_sorted = top_scores_TK.view(-1)[token_indices_experts_sorted]
        token_indices_experts_sorted = token_indices_experts_sorted // K
        routed_input = x_TH[token_indices_experts_sorted]
        # score_before_experts: scale the rows in fp32, then back to the tokens' dtype.
        routed_input = (routed_input.to(torch.float32) * top_scores_experts_sorted.reshape(-1, 1)).to(x_TH.dtype)

        routed_input = funcol.all_to_all_single_autograd(routed_input, output_splits, input_splits, self.group)
        routed_output = self.experts(routed_input, chunk_sizes)
        routed_output = funcol.all_to_all_single_autograd(routed_output, input_splits, output_splits, self.group)

        index = token_indices_experts_sorted.reshape(-1, 1).expand(-1, x_TH.shape[-1])
        return torch.zeros_like(x_TH).scatter_add(0, index, routed_output)

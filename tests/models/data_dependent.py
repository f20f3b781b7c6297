"""An expert-parallel MoE layer whose dispatcher computes data-dependent shapes (issue 11, idiom 1).

Written the way megatron-core 0.6-0.8's ``MoEAlltoAllTokenDispatcher`` and Hugging Face style expert loops
write it, on top of the all-to-all pattern every EP dispatcher shares:

    router      softmax (fp32) -> topk                                               scores_TK, ids_TK
    counts      one-hot of the ids summed per expert (a boolean mask), all-to-all -> (N, E_l)
    permute     argsort(ids.flatten()) -> order; x[order // K]; all_to_all_single
    regroup     expert of each received row: repeat_interleave(arange(E_l).repeat(N), counts)   (data-dependent)
                stable argsort of it -> rows grouped by local expert (Megatron's ``permute``)
    experts     per local expert: rows[boolean mask] -> SwiGLU -> index_copy at nonzero(mask)  (data-dependent)
    unpermute   zeros_like(out).index_copy_(0, regroup order, out); all_to_all_single back
    combine     zeros(T, H).index_add_(0, order // K, back * scores.flatten()[order])

With Dynamo's defaults, ``.tolist()``, ``repeat_interleave`` of a counts tensor, the boolean mask index and
``nonzero`` each break the graph; ``backend="relaymoe"`` captures them (relay_compile/runtime/dynamo_settings.py).

Legend: T tokens, H hidden, F expert width, E experts, E_l local experts, K top-k, N ranks, R received rows.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from tests.models.ep_layer import EPLayer


class DataDependentMoE(EPLayer):
    """EP MoE whose dispatcher regroups received rows with repeat_interleave, boolean masks and nonzero
    (arguments: ``EPLayer``)."""

    def experts(self, rows_RH: Tensor, counts_NL: Tensor) -> Tensor:
        """Received rows (source-major, then local expert) -> expert outputs in the same order."""
        N, El = self.ep_size, self.num_local_experts
        # Megatron 0.7: the local expert of every received row, then rows grouped by expert (stable).
        expert_ids_per_ep_rank = torch.arange(El, device=rows_RH.device).repeat(N)
        expert_of_row_R = torch.repeat_interleave(expert_ids_per_ep_rank, counts_NL.flatten())
        regroup_R = torch.argsort(expert_of_row_R, stable=True)
        grouped_RH = rows_RH.index_select(0, regroup_R)
        sorted_expert_R = expert_of_row_R[regroup_R]
        out_RH = torch.zeros_like(grouped_RH)
        for e in range(El):
            mask_R = sorted_expert_R == e
            x_eH = grouped_RH[mask_R]  # boolean mask: rows of expert e
            y_eH = self.expert(e, x_eH)
            out_RH = out_RH.index_copy(0, torch.nonzero(mask_R).squeeze(1), y_eH)
        # Megatron's unpermute: back to the received order.
        unpermuted_RH = torch.zeros_like(out_RH)
        unpermuted_RH.index_copy_(0, regroup_R, out_RH)
        return unpermuted_RH

    def forward(self, x_TH: Tensor) -> Tensor:
        N, E, El, K = self.ep_size, self.num_experts, self.num_local_experts, self.top_k
        probs_TE = torch.softmax(self.router(x_TH).float(), dim=-1)
        scores_TK, ids_TK = torch.topk(probs_TE, K, dim=-1)
        counts_E = (ids_TK.flatten()[:, None] == torch.arange(E, device=x_TH.device)).sum(0)
        counts_NL = funcol.all_to_all_single(counts_E, None, None, self.group).view(N, El)
        # NOTE: device-to-host sync (split sizes become unbacked SymInts under Dynamo).
        send_splits = counts_E.view(N, El).sum(1).tolist()
        recv_splits = counts_NL.sum(1).tolist()
        order_P = torch.argsort(ids_TK.flatten(), stable=True)
        send_PH = x_TH[order_P // K]
        recv_RH = funcol.all_to_all_single_autograd(send_PH, recv_splits, send_splits, self.group)
        out_RH = self.experts(recv_RH, counts_NL)
        back_PH = funcol.all_to_all_single_autograd(out_RH, send_splits, recv_splits, self.group)
        weighted_PH = back_PH * scores_TK.flatten()[order_P].unsqueeze(-1).to(back_PH.dtype)
        return torch.zeros_like(x_TH).index_add_(0, order_P // K, weighted_PH)

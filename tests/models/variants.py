"""Variants of the reference all-to-all layer in other codebases' idioms: the matcher rewrites some (in-place
combine, scores before the experts), and must leave the others unchanged, with a reason.

Each is ``fn(x_TH, topk_ids_TK, topk_scores_TK, w1, w2, w3, *, group) -> y_TH`` built from the reference's own
steps (``relay_compile.reference``), so everything but the one unsupported feature is the matched pattern.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import Tensor

from relay_compile.reference import (
    _combine_tokens,
    _count_pairs_per_expert,
    _dispatch_tokens,
    _exchange_counts,
    _permute_pairs,
    _split_sizes,
    _weighted_combine,
    local_experts,
)


def _dispatch(x_TH: Tensor, ids_TK: Tensor, w1: Tensor, group: dist.ProcessGroup):
    world = dist.get_world_size(group)
    counts_E = _count_pairs_per_expert(ids_TK, w1.shape[0] * world)
    recv_counts_NL = _exchange_counts(counts_E, world, group)
    send_splits, recv_splits = _split_sizes(counts_E, recv_counts_NL)
    order_P, send_PH = _permute_pairs(x_TH, ids_TK)
    return order_P, send_PH, recv_counts_NL, send_splits, recv_splits


def a2a_moe_graph_break(x_TH, ids_TK, scores_TK, w1, w2, w3, *, group):
    """A graph break between the two all-to-alls: each graph holds one half of the region."""
    order_P, send_PH, counts_NL, send_splits, recv_splits = _dispatch(x_TH, ids_TK, w1, group)
    recv_RH = _dispatch_tokens(send_PH, send_splits, recv_splits, group)
    torch._dynamo.graph_break()
    out_RH = local_experts(recv_RH, counts_NL, w1, w2, w3, use_grouped_mm=False)
    back_PH = _combine_tokens(out_RH, send_splits, recv_splits, group)
    return _weighted_combine(back_PH, order_P, scores_TK)


def a2a_moe_breaks_on_rank_0(x_TH, ids_TK, scores_TK, w1, w2, w3, *, group):
    """A graph break between the two all-to-alls on rank 0 only (a debugging hook on one rank): rank 0's
    graphs hold half a region each, the other ranks' the whole block."""
    order_P, send_PH, counts_NL, send_splits, recv_splits = _dispatch(x_TH, ids_TK, w1, group)
    recv_RH = _dispatch_tokens(send_PH, send_splits, recv_splits, group)
    if dist.get_rank(group) == 0:
        torch._dynamo.graph_break()
    out_RH = local_experts(recv_RH, counts_NL, w1, w2, w3, use_grouped_mm=False)
    back_PH = _combine_tokens(out_RH, send_splits, recv_splits, group)
    return _weighted_combine(back_PH, order_P, scores_TK)


def a2a_moe_warns_on_rank_0(x_TH, ids_TK, scores_TK, w1, w2, w3, *, group):
    """A ``warnings.warn`` and a ``print`` between the two all-to-alls on rank 0 only (Dynamo breaks the graph
    at each, by default)."""
    order_P, send_PH, counts_NL, send_splits, recv_splits = _dispatch(x_TH, ids_TK, w1, group)
    recv_RH = _dispatch_tokens(send_PH, send_splits, recv_splits, group)
    if dist.get_rank(group) == 0:
        warnings.warn("rank 0 received its tokens", stacklevel=1)
        print("rank 0: the experts run on rows of", recv_RH.dtype)  # a size (a SymInt) would still break
    out_RH = local_experts(recv_RH, counts_NL, w1, w2, w3, use_grouped_mm=False)
    back_PH = _combine_tokens(out_RH, send_splits, recv_splits, group)
    return _weighted_combine(back_PH, order_P, scores_TK)


def a2a_moe_scores_first(x_TH, ids_TK, scores_TK, w1, w2, w3, *, group):
    """Scores scale the tokens before the experts, and the combine adds the rows unweighted (DeepSpeed,
    Megatron's ``moe_apply_probs_on_input``: a different function, F is not linear)."""
    order_P, send_PH, counts_NL, send_splits, recv_splits = _dispatch(x_TH, ids_TK, w1, group)
    send_PH = send_PH * scores_TK.flatten()[order_P].unsqueeze(-1)
    recv_RH = _dispatch_tokens(send_PH, send_splits, recv_splits, group)
    out_RH = local_experts(recv_RH, counts_NL, w1, w2, w3, use_grouped_mm=False)
    back_PH = _combine_tokens(out_RH, send_splits, recv_splits, group)
    y_TH = back_PH.new_zeros(x_TH.shape)
    return y_TH.index_add(0, order_P // ids_TK.shape[1], back_PH)


def a2a_moe_experts_read_tokens(x_TH, ids_TK, scores_TK, w1, w2, w3, *, group):
    """The experts read the sender's own tokens (a per-rank mean), not only what they received."""
    order_P, send_PH, counts_NL, send_splits, recv_splits = _dispatch(x_TH, ids_TK, w1, group)
    recv_RH = _dispatch_tokens(send_PH, send_splits, recv_splits, group)
    out_RH = local_experts(recv_RH + x_TH.mean(0), counts_NL, w1, w2, w3, use_grouped_mm=False)
    back_PH = _combine_tokens(out_RH, send_splits, recv_splits, group)
    return _weighted_combine(back_PH, order_P, scores_TK)


def a2a_moe_in_place_combine(x_TH, ids_TK, scores_TK, w1, w2, w3, *, group):
    """The combine scatters in place into a fresh buffer that is then returned (DeepSpeed/fairseq style:
    ``y = zeros_like(x); y.index_add_(0, idx, v); return y``)."""
    order_P, send_PH, counts_NL, send_splits, recv_splits = _dispatch(x_TH, ids_TK, w1, group)
    recv_RH = _dispatch_tokens(send_PH, send_splits, recv_splits, group)
    out_RH = local_experts(recv_RH, counts_NL, w1, w2, w3, use_grouped_mm=False)
    back_PH = _combine_tokens(out_RH, send_splits, recv_splits, group)
    y_TH = torch.zeros_like(x_TH)
    y_TH.index_add_(0, order_P // ids_TK.shape[1], back_PH * scores_TK.flatten()[order_P].unsqueeze(-1))
    return y_TH

"""The reference expert-parallel MoE layer: top-k dispatch and combine through all-to-alls, torch-native.

It is the baseline of every comparison, and the program the ``relaymoe`` backend rewrites: Dynamo traces
``a2a_moe`` into one graph (``fullgraph=True`` with ``capture_scalar_outputs=True``) whose all-to-alls the
pattern matcher finds (docs/ARCHITECTURE.md, section 3). Each step is a small named function; collectives
live in their own.

Per rank, with N ranks in the group and E_l = E / N local experts (global expert e lives on rank e // E_l):

    counts_E    = zeros(E).scatter_add_(ids)              # pairs per global expert
    counts_NL   = a2a(counts_E)                           # row s: pairs source s sends to my local experts
    order_P     = argsort(ids.flatten(), stable=True)     # pairs sorted by global expert, hence owner rank
    send_PH     = x[order_P // K]                         # the top-k-expanded buffer
    recv_RH     = a2a(send_PH, splits)                    # grouped by source rank, then local expert
    out_RH      = local_experts(recv_RH, counts_NL, w)    # permute expert-major, FFN, unpermute
    back_PH     = a2a(out_RH, splits swapped)
    y_TH        = zeros(T, H).index_add(0, order_P // K, back_PH * scores.flatten()[order_P])

Layout of ``recv_RH`` at N=2, E_l=2 (rows of source s for local expert l): ``(s0,l0) (s0,l1) (s1,l0) (s1,l1)``;
``local_experts`` reorders it to ``(s0,l0) (s1,l0) (s0,l1) (s1,l1)`` for the grouped GEMMs and back.

Legend: T local tokens, K top-k, H hidden, F expert FFN width, E experts, L = E_l local experts, N ranks,
P = T*K pairs this rank sends, R rows this rank receives, B batch, S sequence (in ``AllToAllMoE.forward``).
"""

from __future__ import annotations

import logging
from typing import TypeAlias

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as nnf
from torch import Tensor, nn
from torch.distributed.distributed_c10d import _get_group_size_by_name, _resolve_process_group

from relay_compile.experts import ACTIVATIONS, GATED, Activation, activation_fn, expert_ffn

log = logging.getLogger(__name__)

__all__ = [
    "a2a_moe",
    "local_experts",
    "qwen3_route",
    "Qwen3Router",
    "swiglu_mlp",
    "AllToAllMoE",
    "moe_weights",
    "dense_moe",
    "dense_moe_block",
]


# ----------------------------------------------------------------------------------------------------------
# Process group helpers
# ----------------------------------------------------------------------------------------------------------


# An EP group: a ProcessGroup or its name (``group.group_name``); functional collectives take either. Compiled
# code gets the name (docs/ARCHITECTURE.md section 5): Dynamo keeps a str as a constant, but it cannot proxy every
# ProcessGroup (torch 2.11 sees a Python subclass, such as the bench's stand-in group, as a user object and
# fails on the first collective).
Group: TypeAlias = dist.ProcessGroup | str


def _resolve_group(group: Group | None) -> Group | None:
    """The group to run collectives on: ``group`` (a name stays a name), else the default group, else None."""
    if group is not None:
        return group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def _group_size(group: Group | None) -> int:
    """World size of ``group``; 1 without a process group.

    By name through ``_get_group_size_by_name``, which Dynamo constant-folds for a constant name (no graph
    break, no proxy of the group object); ``dist.get_world_size`` does not take a name.
    """
    if group is None:
        return 1
    if isinstance(group, str):
        return _get_group_size_by_name(group)
    return dist.get_world_size(group)


def _group_size_rank(group: Group | None) -> tuple[int, int]:
    """(world size, rank) of ``group``; (1, 0) without a process group. Eager code only (module setup)."""
    if group is None:
        return 1, 0
    if isinstance(group, str):
        group = _resolve_process_group(group)
    return dist.get_world_size(group), dist.get_rank(group)


# ----------------------------------------------------------------------------------------------------------
# a2a_moe steps
# ----------------------------------------------------------------------------------------------------------


def _count_pairs_per_expert(topk_ids_TK: Tensor, num_experts: int) -> Tensor:
    """Pairs per global expert, int64 ``(E,)``. ``scatter_add_``, not ``bincount``: its size is data-dependent."""
    ids_P = topk_ids_TK.flatten().to(torch.int64)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=topk_ids_TK.device)
    return counts_E.scatter_add_(0, ids_P, torch.ones_like(ids_P))


def _exchange_counts(counts_E: Tensor, world: int, group: Group | None) -> Tensor:
    """All-to-all of the counts: ``(N, E_l)`` int64, row s = pairs source s sends to each of my local experts."""
    if world == 1:
        return counts_E.view(1, -1)
    recv_E = funcol.all_to_all_single(counts_E, None, None, group)
    return funcol.wait_tensor(recv_E).view(world, -1)


def _split_sizes(counts_E: Tensor, recv_counts_NL: Tensor) -> tuple[list[int], list[int]]:
    """Host split sizes (send to each rank, receive from each rank), one sync for both."""
    world = recv_counts_NL.shape[0]
    splits_2N = torch.stack([counts_E.view(world, -1).sum(1), recv_counts_NL.sum(1)])
    send_splits, recv_splits = splits_2N.tolist()  # NOTE: device-to-host sync
    for v in send_splits + recv_splits:
        torch._check(v >= 0)  # unbacked SymInts under torch.compile: the compiled backward needs the bound
    return send_splits, recv_splits


def _permute_pairs(x_TH: Tensor, topk_ids_TK: Tensor) -> tuple[Tensor, Tensor]:
    """Sort the (token, expert) pairs by global expert and gather their tokens.

    Returns:
        order_P: pair indices sorted by expert ``(P,)``; ``order_P // K`` is the token of each sorted pair.
        send_PH: ``x[order_P // K]`` ``(P, H)``, the top-k-expanded dispatch buffer.
    """
    top_k = topk_ids_TK.shape[1]
    order_P = torch.argsort(topk_ids_TK.flatten(), stable=True)
    send_PH = x_TH[order_P // top_k]
    return order_P, send_PH


def _dispatch_tokens(
    send_PH: Tensor, send_splits: list[int], recv_splits: list[int], group: Group | None
) -> Tensor:
    """Token all-to-all (with autograd): ``(P, H)`` sorted by owner -> ``(R, H)`` grouped by source rank."""
    if group is None:
        return send_PH
    recv_RH = funcol.all_to_all_single_autograd(send_PH, recv_splits, send_splits, group)
    return funcol.wait_tensor(recv_RH)


def _combine_tokens(
    out_RH: Tensor, send_splits: list[int], recv_splits: list[int], group: Group | None
) -> Tensor:
    """Reverse token all-to-all (with autograd): ``(R, H)`` back to the senders, ``(P, H)`` in ``order_P``."""
    if group is None:
        return out_RH
    back_PH = funcol.all_to_all_single_autograd(out_RH, send_splits, recv_splits, group)
    return funcol.wait_tensor(back_PH)


def _expert_major_order(recv_counts_NL: Tensor, num_rows: int) -> Tensor:
    """Permutation of the received rows from source-major to expert-major, ``(R,)``.

    Row r of ``recv`` belongs to block ``(s, l)`` in source-major order; a stable sort by ``l`` keeps the
    sources in order inside each local expert.
    """
    world, num_local = recv_counts_NL.shape
    block_expert_NL = torch.arange(world * num_local, device=recv_counts_NL.device) % num_local
    expert_of_row_R = torch.repeat_interleave(block_expert_NL, recv_counts_NL.flatten(), output_size=num_rows)
    return torch.argsort(expert_of_row_R, stable=True)


def local_experts(
    recv_RH: Tensor,
    recv_counts_NL: Tensor,
    w1_LFH: Tensor,
    w2_LHF: Tensor,
    w3_LFH: Tensor | None = None,
    *,
    activation: Activation = "swiglu",
    use_grouped_mm: bool | None = None,
) -> Tensor:
    """The owner's block between the two all-to-alls: permute to expert-major, ``expert_ffn``, unpermute.

    Args:
        recv_RH: received rows, grouped by source rank then local expert ``(R, H)``.
        recv_counts_NL: int64 ``(N, E_l)``, rows from each source for each local expert; sums to R.
        w1_LFH, w3_LFH: ``(E_l, F, H)``; w2_LHF: ``(E_l, H, F)``.

    Returns:
        ``(R, H)``: each row's expert output, in ``recv_RH``'s order.
    """
    perm_R = _expert_major_order(recv_counts_NL, recv_RH.shape[0])
    sorted_RH = recv_RH[perm_R]
    out_sorted_RH = expert_ffn(
        sorted_RH,
        recv_counts_NL.sum(0),
        w1_LFH,
        w2_LHF,
        w3_LFH,
        activation=activation,
        use_grouped_mm=use_grouped_mm,
    )
    return out_sorted_RH[torch.argsort(perm_R)]


def _weighted_combine(back_PH: Tensor, order_P: Tensor, topk_scores_TK: Tensor) -> Tensor:
    """``y[t] = sum_k scores[t, k] * out[t, k]``: scale the sorted pairs, scatter-add them into ``(T, H)``."""
    num_tokens, top_k = topk_scores_TK.shape
    scores_P = topk_scores_TK.flatten()[order_P].to(back_PH.dtype)
    weighted_PH = back_PH * scores_P.unsqueeze(-1)
    y_TH = back_PH.new_zeros(num_tokens, back_PH.shape[-1])
    return y_TH.index_add(0, order_P // top_k, weighted_PH)


def a2a_moe(
    x_TH: Tensor,
    topk_ids_TK: Tensor,
    topk_scores_TK: Tensor,
    w1_LFH: Tensor,
    w2_LHF: Tensor,
    w3_LFH: Tensor | None = None,
    *,
    group: Group | None = None,
    activation: Activation = "swiglu",
    use_grouped_mm: bool | None = None,
) -> Tensor:
    """Expert-parallel MoE through all-to-alls: ``y[t] = sum_k scores[t, k] * FFN_{ids[t, k]}(x[t])``.

    Args:
        x_TH: this rank's tokens ``(T, H)``.
        topk_ids_TK: GLOBAL expert ids ``(T, K)``; expert e lives on rank ``e // E_l`` of ``group``.
        topk_scores_TK: routing weights ``(T, K)``.
        w1_LFH, w3_LFH: this rank's experts ``(E_l, F, H)`` (w3 only for gated activations); w2_LHF: ``(E_l, H, F)``.
        group: the EP group, or its name (``group.group_name``: what compiled callers pass,
            docs/ARCHITECTURE.md section 5); None means the default group, or one process without collectives.
        use_grouped_mm: see ``expert_ffn``; False for fp32 under ``torch.compile``.

    Returns:
        ``(T, H)`` in ``x``'s dtype. Differentiable to x, scores and the weights.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"a2a_moe: activation={activation!r} is not one of {ACTIVATIONS}")
    group = _resolve_group(group)
    world = _group_size(group)
    if world == 1:
        group = None
    num_experts = w1_LFH.shape[0] * world
    counts_E = _count_pairs_per_expert(topk_ids_TK, num_experts)
    recv_counts_NL = _exchange_counts(counts_E, world, group)
    send_splits, recv_splits = _split_sizes(counts_E, recv_counts_NL) if group is not None else ([], [])
    order_P, send_PH = _permute_pairs(x_TH, topk_ids_TK)
    recv_RH = _dispatch_tokens(send_PH, send_splits, recv_splits, group)
    out_RH = local_experts(
        recv_RH, recv_counts_NL, w1_LFH, w2_LHF, w3_LFH, activation=activation, use_grouped_mm=use_grouped_mm
    )
    back_PH = _combine_tokens(out_RH, send_splits, recv_splits, group)
    return _weighted_combine(back_PH, order_P, topk_scores_TK)


# ----------------------------------------------------------------------------------------------------------
# Router and shared expert
# ----------------------------------------------------------------------------------------------------------


def qwen3_route(x_TH: Tensor, gate_EH: Tensor, top_k: int, norm_topk_prob: bool = True) -> tuple[Tensor, Tensor]:
    """Qwen3-MoE routing: softmax over ``x @ gate.T`` in fp32, top-k, optional renormalization.

    Returns:
        topk_ids_TK: int64 global expert ids ``(T, K)``.
        topk_scores_TK: ``(T, K)`` in ``x``'s dtype.
    """
    logits_TE = x_TH @ gate_EH.T
    probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
    scores_TK, ids_TK = torch.topk(probs_TE, top_k, dim=-1)
    if norm_topk_prob:
        scores_TK = scores_TK / scores_TK.sum(dim=-1, keepdim=True)
    return ids_TK, scores_TK.to(x_TH.dtype)


class Qwen3Router(nn.Module):
    """Replicated router: ``weight (E, H)``; ``forward(x_TH) -> (topk_ids_TK, topk_scores_TK)``."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool = True,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype, device=device))
        nn.init.normal_(self.weight, std=hidden**-0.5)

    def forward(self, x_TH: Tensor) -> tuple[Tensor, Tensor]:
        return qwen3_route(x_TH, self.weight, self.top_k, self.norm_topk_prob)


def swiglu_mlp(x_TH: Tensor, w1_FH: Tensor, w2_HF: Tensor, w3_FH: Tensor) -> Tensor:
    """Dense SwiGLU MLP ``w2 @ (silu(w1 @ x) * (w3 @ x))``: ``(T, H) -> (T, H)``."""
    return (nnf.silu(x_TH @ w1_FH.T) * (x_TH @ w3_FH.T)) @ w2_HF.T


# ----------------------------------------------------------------------------------------------------------
# Deterministic weights, identical for any EP layout
# ----------------------------------------------------------------------------------------------------------

# Index of each tensor name in the seed derivation: a name's stream never depends on another's shape.
_WEIGHT_KEYS = {"gate": 0, "w1": 1, "w2": 2, "w3": 3, "shared_w1": 4, "shared_w2": 5, "shared_w3": 6}


def _seeded_randn(seed: int, name: str, index: int, shape: tuple[int, ...], fan_in: int) -> Tensor:
    """``N(0, 1/fan_in)`` fp32 on CPU, a pure function of (seed, name, index): expert e is the same on any rank."""
    gen = torch.Generator(device="cpu").manual_seed((seed * 16 + _WEIGHT_KEYS[name]) * 1_000_003 + index)
    return torch.randn(shape, generator=gen) * fan_in**-0.5


def moe_weights(
    seed: int,
    hidden: int,
    ffn: int,
    num_experts: int,
    *,
    experts: range | None = None,
    activation: Activation = "swiglu",
    shared_ffn: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> dict[str, Tensor]:
    """The weights of one MoE block, for the experts in ``experts`` (default all), deterministic in ``seed``.

    Returns a dict: ``gate (E, H)``, ``w1 (X, F, H)``, ``w2 (X, H, F)``, ``w3 (X, F, H)`` (swiglu only),
    and with ``shared_ffn > 0`` ``shared_w1 (Fs, H)``, ``shared_w2 (H, Fs)``, ``shared_w3 (Fs, H)``;
    X = ``len(experts)``.
    """
    experts = range(num_experts) if experts is None else experts
    shapes = {"w1": ((ffn, hidden), hidden), "w2": ((hidden, ffn), ffn)}
    if activation in GATED:
        shapes["w3"] = ((ffn, hidden), hidden)
    out = {"gate": _seeded_randn(seed, "gate", 0, (num_experts, hidden), hidden)}
    for name, (shape, fan_in) in shapes.items():
        out[name] = torch.stack([_seeded_randn(seed, name, e, shape, fan_in) for e in experts])
    if shared_ffn > 0:
        out["shared_w1"] = _seeded_randn(seed, "shared_w1", 0, (shared_ffn, hidden), hidden)
        out["shared_w2"] = _seeded_randn(seed, "shared_w2", 0, (hidden, shared_ffn), shared_ffn)
        out["shared_w3"] = _seeded_randn(seed, "shared_w3", 0, (shared_ffn, hidden), hidden)
    return {k: v.to(device=device, dtype=dtype) for k, v in out.items()}


# ----------------------------------------------------------------------------------------------------------
# The module
# ----------------------------------------------------------------------------------------------------------


class AllToAllMoE(nn.Module):
    """Qwen3-style MoE block with expert parallelism through all-to-alls.

    Parameters: ``router.weight (E, H)`` replicated; this rank's experts ``w1 (E_l, F, H)``, ``w2 (E_l, H, F)``,
    ``w3 (E_l, F, H)`` (swiglu only; torchtitan layout); with ``shared_ffn > 0`` a replicated SwiGLU shared
    expert ``shared_w1 (Fs, H)``, ``shared_w2 (H, Fs)``, ``shared_w3 (Fs, H)``, computed outside the a2a.

    ``forward(x_BSH) -> y_BSH``. Weights are ``moe_weights(seed, ...)`` sliced to this rank's experts, so the
    block equals ``dense_moe_block`` with ``self.full_weights(seed)`` at any EP size. ``seed=None`` draws the
    seed from torch's default generator (same on every rank when ranks seed alike).
    """

    def __init__(
        self,
        hidden: int,
        ffn: int,
        num_experts: int,
        top_k: int,
        group: Group | None = None,
        norm_topk_prob: bool = True,
        shared_ffn: int = 0,
        activation: Activation = "swiglu",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        *,
        seed: int | None = None,
        use_grouped_mm: bool | None = None,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"AllToAllMoE: activation={activation!r} is not one of {ACTIVATIONS}")
        self.group = _resolve_group(group)
        world, rank = _group_size_rank(self.group)
        if num_experts % world:
            raise ValueError(f"AllToAllMoE: num_experts={num_experts} is not divisible by the EP size {world}")
        self.hidden, self.ffn, self.num_experts, self.top_k = hidden, ffn, num_experts, top_k
        self.shared_ffn, self.activation, self.use_grouped_mm = shared_ffn, activation, use_grouped_mm
        num_local = num_experts // world
        self.local_experts = range(rank * num_local, (rank + 1) * num_local)
        factory = {"dtype": dtype, "device": device}
        self.router = Qwen3Router(hidden, num_experts, top_k, norm_topk_prob, **factory)
        self.w1 = nn.Parameter(torch.empty(num_local, ffn, hidden, **factory))
        self.w2 = nn.Parameter(torch.empty(num_local, hidden, ffn, **factory))
        self.w3 = nn.Parameter(torch.empty(num_local, ffn, hidden, **factory)) if activation in GATED else None
        if shared_ffn > 0:
            self.shared_w1 = nn.Parameter(torch.empty(shared_ffn, hidden, **factory))
            self.shared_w2 = nn.Parameter(torch.empty(hidden, shared_ffn, **factory))
            self.shared_w3 = nn.Parameter(torch.empty(shared_ffn, hidden, **factory))
        if seed is None:
            seed = int(torch.randint(0, 2**31 - 1, ()).item())
        self.init_weights(seed)
        log.debug("AllToAllMoE: EP rank %d/%d owns experts %s", rank, world, self.local_experts)

    def full_weights(self, seed: int) -> dict[str, Tensor]:
        """All experts' weights for ``seed`` (see ``moe_weights``), on this module's device and dtype."""
        return moe_weights(
            seed,
            self.hidden,
            self.ffn,
            self.num_experts,
            activation=self.activation,
            shared_ffn=self.shared_ffn,
            dtype=self.w1.dtype,
            device=self.w1.device,
        )

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Load ``moe_weights(seed)`` for this rank's experts: identical to the dense single-process model."""
        weights = moe_weights(
            seed,
            self.hidden,
            self.ffn,
            self.num_experts,
            experts=self.local_experts,
            activation=self.activation,
            shared_ffn=self.shared_ffn,
            dtype=self.w1.dtype,
            device=self.w1.device,
        )
        self.router.weight.copy_(weights.pop("gate"))
        for name, value in weights.items():
            getattr(self, name).copy_(value)

    def forward(self, x_BSH: Tensor) -> Tensor:
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        topk_ids_TK, topk_scores_TK = self.router(x_TH)
        y_TH = a2a_moe(
            x_TH,
            topk_ids_TK,
            topk_scores_TK,
            self.w1,
            self.w2,
            self.w3,
            group=self.group,
            activation=self.activation,
            use_grouped_mm=self.use_grouped_mm,
        )
        if self.shared_ffn > 0:
            y_TH = y_TH + swiglu_mlp(x_TH, self.shared_w1, self.shared_w2, self.shared_w3)
        return y_TH.view_as(x_BSH)


# ----------------------------------------------------------------------------------------------------------
# Ground truth: one process, all experts, a plain loop
# ----------------------------------------------------------------------------------------------------------


def _dense_ffn(x_XH: Tensor, w1_FH: Tensor, w2_HF: Tensor, w3_FH: Tensor | None, activation: Activation) -> Tensor:
    """One expert's FFN on its rows ``(X, H) -> (X, H)``."""
    h_XF = activation_fn(activation)(x_XH @ w1_FH.T)
    if activation in GATED:
        assert w3_FH is not None, f"{activation} needs w3"
        h_XF = h_XF * (x_XH @ w3_FH.T)
    return h_XF @ w2_HF.T


def dense_moe(
    x_TH: Tensor,
    topk_ids_TK: Tensor,
    topk_scores_TK: Tensor,
    w1_EFH: Tensor,
    w2_EHF: Tensor,
    w3_EFH: Tensor | None = None,
    activation: Activation = "swiglu",
    scores_applied: str = "after",
) -> Tensor:
    """Ground truth of ``a2a_moe`` on one process with ALL experts' weights ``(E, F, H)``: a loop over experts.

    Returns ``(T, H)``: ``sum_k scores[t, k] * FFN_{ids[t, k]}(x[t])`` (``scores_applied="before"``:
    ``sum_k FFN_{ids[t, k]}(scores[t, k] * x[t])``); differentiable like ``a2a_moe``.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"dense_moe: activation={activation!r} is not one of {ACTIVATIONS}")
    y_TH = torch.zeros_like(x_TH)
    for e in range(w1_EFH.shape[0]):
        token_X, slot_X = torch.nonzero(topk_ids_TK == e, as_tuple=True)
        if token_X.numel() == 0:
            continue
        w3_FH = None if w3_EFH is None else w3_EFH[e]
        score_X1 = topk_scores_TK[token_X, slot_X].to(x_TH.dtype).unsqueeze(-1)
        if scores_applied == "before":
            y_TH = y_TH.index_add(0, token_X, _dense_ffn(x_TH[token_X] * score_X1, w1_EFH[e], w2_EHF[e], w3_FH,
                                                         activation))
            continue
        out_XH = _dense_ffn(x_TH[token_X], w1_EFH[e], w2_EHF[e], w3_FH, activation)
        y_TH = y_TH.index_add(0, token_X, out_XH * score_X1)
    return y_TH


def dense_moe_block(
    x_BSH: Tensor,
    weights: dict[str, Tensor],
    top_k: int,
    norm_topk_prob: bool = True,
    activation: Activation = "swiglu",
) -> Tensor:
    """Ground truth of ``AllToAllMoE`` with ``weights = moe_weights(...)`` of all experts: ``(B, S, H)``."""
    x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
    topk_ids_TK, topk_scores_TK = qwen3_route(x_TH, weights["gate"], top_k, norm_topk_prob)
    y_TH = dense_moe(
        x_TH, topk_ids_TK, topk_scores_TK, weights["w1"], weights["w2"], weights.get("w3"), activation
    )
    if "shared_w1" in weights:
        y_TH = y_TH + swiglu_mlp(x_TH, weights["shared_w1"], weights["shared_w2"], weights["shared_w3"])
    return y_TH.view_as(x_BSH)

"""A small Megatron-style expert-parallel MoE layer (from notes/megatron_style.py).

Modelled on megatron-core's ``MoEAlltoAllTokenDispatcher`` + ``SequentialMLP`` (which need CUDA):

    router      nn.Linear(H, E) -> softmax (fp32) -> topk                                  scores_TK, ids_TK
    counts      routing_map[T, E].sum(0); all_gather -> (N, E); this rank's columns (N, E_l)  (NOT an a2a)
    splits      input_splits = local counts per destination rank (N SymInts);
                chunk_sizes = received counts per (source, local expert) (N*E_l SymInts)
    permute     sort(ids.flatten(), stable) -> order; x.index_select(0, order // K)
    dispatch    all_to_all_single_autograd; split into (source, expert) chunks, regroup expert-major,
                loop over nn.ModuleList experts (fc1 -> silu(gate) * up -> fc2), back to rank-major
    combine     all_to_all_single_autograd; y = zeros(T, H).index_add_(0, order // K, back * scores[order])

With ``counts_in_experts`` the expert side is megatron-core's ``sort_chunks_by_idxs`` + ``SequentialMLP``: rows
sorted expert-major, split by ``tokens_per_expert.tolist()`` (the experts read this rank's columns of the gathered
counts as a tensor), sorted back. With ``grouped_linear`` (a class with Transformer Engine's ``GroupedLinear``
interface: TE's own on CUDA, ``tests.models.te_grouped_linear`` on CPU) it is ``TEGroupedMLP``: ``linear_fc1`` and
``linear_fc2`` hold the local experts' weights (``weight{i}``) and run over ``tokens_per_expert.tolist()``.

y[t] = sum_k score[t, k] * expert_{ids[t, k]}(x[t]); rank r owns experts [r*E_l, (r+1)*E_l).

Legend: T tokens, H hidden, F expert width, E experts, E_l local experts, K top-k, N ranks, R received rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as nnf
from torch import Tensor, nn

# all_gather_tensor is deprecated in torch 2.13 in favour of all_gather_single (same op:
# _c10d_functional.all_gather_into_tensor); torch 2.11 only has the old name.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


class Expert(nn.Module):
    """Megatron MLP with a gated linear unit: fc1 (H -> 2F), silu(gate) * up, fc2 (F -> H); ``bias``: Megatron's
    ``add_bias_linear`` (fc1 and fc2 with biases)."""

    def __init__(self, dim: int, hidden: int, bias: bool = False) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, 2 * hidden, bias=bias)
        self.linear_fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x_RH: Tensor) -> Tensor:
        gate_RF, up_RF = self.linear_fc1(x_RH).chunk(2, dim=-1)
        return self.linear_fc2(nnf.silu(gate_RF) * up_RF)


class MegatronStyleMoE(nn.Module):
    """EP MoE with all_gather counts, sort + index_select permute, looped experts, index_add_ combine.

    Args:
        dim, hidden, num_experts, top_k: H, F, E, K.
        group: the EP process group (N ranks); this rank owns E/N consecutive experts.
        seed: every rank builds all E experts and the router from this seed and keeps its own experts,
            so ``all_experts(seed)`` gives the same weights for a dense reference.
        bias: experts' ``nn.Linear`` layers with biases.
        counts_in_experts: megatron-core's expert side: the received rows sorted expert-major
            (``sort_chunks_by_idxs``), split per expert by ``tokens_per_expert.tolist()`` with
            ``tokens_per_expert = num_global_tokens_per_local_expert.sum(dim=0)`` (``SequentialMLP``), so the
            experts read this rank's columns of the all-gathered counts as a tensor.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, group: dist.ProcessGroup,
                 *, seed: int = 0, bias: bool = False, counts_in_experts: bool = False,
                 grouped_linear: type[nn.Module] | None = None, counts_exchange: str = "all_gather",
                 **grouped_linear_kwargs: object) -> None:
        super().__init__()
        self.counts_in_experts = counts_in_experts
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        assert num_experts % self.ep_size == 0
        self.num_experts, self.top_k = num_experts, top_k
        self.num_local_experts = num_experts // self.ep_size
        router, experts = self.build_all(dim, hidden, num_experts, seed, bias)
        self.router = router
        lo = self.ep_rank * self.num_local_experts
        self.local_experts = nn.ModuleList(experts[lo:lo + self.num_local_experts])
        self.grouped = grouped_linear is not None
        self.counts_exchange = counts_exchange
        if grouped_linear is not None:  # megatron-core's TEGroupedMLP: the local experts' weights in two modules
            self.counts_in_experts = True
            self.linear_fc1, self.linear_fc2 = (
                grouped_linear(self.num_local_experts, n_in, n_out, bias=bias, **grouped_linear_kwargs)
                for n_in, n_out in ((dim, 2 * hidden), (hidden, dim)))
            with torch.no_grad():
                for i, expert in enumerate(self.local_experts):
                    for mine, theirs in ((self.linear_fc1, expert.linear_fc1), (self.linear_fc2, expert.linear_fc2)):
                        getattr(mine, f"weight{i}").copy_(theirs.weight)
                        if bias:
                            getattr(mine, f"bias{i}").copy_(theirs.bias)
            del self.local_experts

    @staticmethod
    def build_all(dim: int, hidden: int, num_experts: int, seed: int,
                  bias: bool = False) -> tuple[nn.Linear, list[Expert]]:
        """The router and all E experts for ``seed`` (identical on every rank)."""
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        router = nn.Linear(dim, num_experts, bias=False)
        experts = [Expert(dim, hidden, bias) for _ in range(num_experts)]
        torch.random.set_rng_state(gen_state)
        return router, experts

    def forward(self, x_TH: Tensor) -> Tensor:
        T = x_TH.shape[0]
        N, E, El, K = self.ep_size, self.num_experts, self.num_local_experts, self.top_k

        probs_TE = torch.softmax(self.router(x_TH).float(), dim=-1)
        scores_TK, ids_TK = torch.topk(probs_TE, K, dim=-1)
        routing_map_TE = torch.zeros(T, E, dtype=torch.bool, device=x_TH.device).scatter(1, ids_TK, True)
        num_local_tokens_per_expert_E = routing_map_TE.sum(dim=0)

        if self.counts_exchange == "all_to_all":  # for the stand-in group of simulated EP (bench), which mirrors
            num_global_tokens_per_local_expert_NEl = funcol.all_to_all_single(  # all-to-alls, not all-gathers
                num_local_tokens_per_expert_E, None, None, self.group).view(N, El)
        else:  # Counts exchange: all_gather of per-expert counts (Megatron), not an all-to-all.
            num_global_tokens_per_expert_NE = _all_gather(
                num_local_tokens_per_expert_E, gather_dim=0, group=self.group).view(N, E)
            lo = self.ep_rank * El
            num_global_tokens_per_local_expert_NEl = num_global_tokens_per_expert_NE[:, lo:lo + El]

        # NOTE: device-to-host sync (split sizes become unbacked SymInts under Dynamo).
        input_splits = num_local_tokens_per_expert_E.view(N, El).sum(dim=1).tolist()
        chunk_sizes = num_global_tokens_per_local_expert_NEl.reshape(-1).tolist()
        output_splits = [sum(chunk_sizes[s * El:(s + 1) * El]) for s in range(N)]

        _, order_N = torch.sort(ids_TK.reshape(-1), stable=True)
        token_idx_N = order_N // K
        permuted_NH = x_TH.index_select(0, token_idx_N)

        recv_RH = funcol.all_to_all_single_autograd(permuted_NH, output_splits, input_splits, self.group)

        chunks = torch.split(recv_RH, chunk_sizes)
        if self.counts_in_experts:
            expert_out_RH = self._sequential_mlp(chunks, chunk_sizes, num_global_tokens_per_local_expert_NEl)
            back_NH = funcol.all_to_all_single_autograd(expert_out_RH, input_splits, output_splits, self.group)
            scores_N = scores_TK.reshape(-1)[order_N].to(back_NH.dtype)
            return torch.zeros_like(x_TH).index_add_(0, token_idx_N, back_NH * scores_N.unsqueeze(-1))
        out_chunks: list[Tensor | None] = [None] * (N * El)
        for e, expert in enumerate(self.local_experts):
            x_e = torch.cat([chunks[s * El + e] for s in range(N)])
            y_e = expert(x_e)
            parts = torch.split(y_e, [chunk_sizes[s * El + e] for s in range(N)])
            for s in range(N):
                out_chunks[s * El + e] = parts[s]
        expert_out_RH = torch.cat(out_chunks)  # type: ignore[arg-type]

        back_NH = funcol.all_to_all_single_autograd(expert_out_RH, input_splits, output_splits, self.group)

        scores_N = scores_TK.reshape(-1)[order_N].to(back_NH.dtype)
        return torch.zeros_like(x_TH).index_add_(0, token_idx_N, back_NH * scores_N.unsqueeze(-1))

    def _sequential_mlp(self, chunks: tuple[Tensor, ...], chunk_sizes: list[int], counts_NEl: Tensor) -> Tensor:
        """megatron-core's expert side: (source, expert) chunks sorted expert-major, ``SequentialMLP`` over
        ``tokens_per_expert.tolist()`` splits, sorted back source-major."""
        N, El = self.ep_size, self.num_local_experts
        x_RH = torch.cat([chunks[s * El + e] for e in range(El) for s in range(N)])
        tokens_per_expert_El = counts_NEl.sum(dim=0)
        if self.grouped:  # TEGroupedMLP: GroupedLinear fc1 -> GLU -> GroupedLinear fc2 over tokens_per_expert
            tokens_per_expert = tokens_per_expert_El.tolist()
            gate_RF, up_RF = self.linear_fc1(x_RH, tokens_per_expert).chunk(2, dim=-1)
            out_RH = self.linear_fc2(nnf.silu(gate_RF) * up_RF, tokens_per_expert)
        else:
            rows_per_expert = torch.split(x_RH, tokens_per_expert_El.tolist())
            out_RH = torch.cat([expert(x_e) for expert, x_e in zip(self.local_experts, rows_per_expert)])
        parts = torch.split(out_RH, [chunk_sizes[s * El + e] for e in range(El) for s in range(N)])
        return torch.cat([parts[e * N + s] for s in range(N) for e in range(El)])

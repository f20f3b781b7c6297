"""The tensors of one measurement: tokens, Qwen3 routing, this rank's experts and an output gradient.

Routing of every configuration: the Qwen3 router (``relay_compile.reference.qwen3_route``: softmax of
``x @ gate.T`` in fp32, top-k, renormalized) over tokens ``x ~ N(0, 1)`` and a seeded gate ``N(0, 1/H)``.
Everything is seeded by ``LayerConfig.seed``: the same configuration gets the same tensors on any call.

Legend: T tokens per rank, H hidden, K top-k, E experts, E_l = E / N experts on this rank (N EP size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from relay_compile.bench.configs import LayerConfig
from relay_compile.reference import moe_weights, qwen3_route


@dataclass(kw_only=True)
class LayerInputs:
    """Resident tensors of one measurement: tokens, routing, this rank's experts and an output gradient."""

    x_TH: Tensor
    topk_ids_TK: Tensor
    topk_scores_TK: Tensor
    weights: list[Tensor]
    grad_y_TH: Tensor

    def leaves(self) -> list[Tensor]:
        return [self.x_TH, self.topk_scores_TK, *self.weights]

    def resident_bytes(self) -> int:
        tensors = [self.x_TH, self.topk_ids_TK, self.topk_scores_TK, self.grad_y_TH, *self.weights]
        return sum(t.numel() * t.element_size() for t in tensors)

    def clear_grads(self) -> None:
        for t in self.leaves():
            t.grad = None


def make_weights(cfg: LayerConfig) -> list[Tensor]:
    """This rank's ``E_l`` experts (``moe_weights`` seeded: the same experts on any device)."""
    w = moe_weights(cfg.seed, cfg.hidden, cfg.ffn, cfg.experts_per_rank, dtype=cfg.torch_dtype, device=cfg.device)
    return [w["w1"].requires_grad_(), w["w2"].requires_grad_(), w["w3"].requires_grad_()]


def make_inputs(cfg: LayerConfig, weights: list[Tensor] | None = None) -> LayerInputs:
    """Tokens, Qwen3 routing over all E experts, weights (made unless given) and a fixed output gradient."""
    gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed + 1)
    dt = cfg.torch_dtype
    x_TH = torch.randn(cfg.tokens, cfg.hidden, generator=gen, device=cfg.device, dtype=dt)
    gate_EH = moe_weights(cfg.seed, cfg.hidden, 1, cfg.experts, experts=range(1), dtype=dt, device=cfg.device)["gate"]
    with torch.no_grad():
        ids_TK, scores_TK = qwen3_route(x_TH, gate_EH, cfg.top_k)
    grad_y_TH = torch.randn(cfg.tokens, cfg.hidden, generator=gen, device=cfg.device, dtype=dt)
    return LayerInputs(
        x_TH=x_TH.requires_grad_(), topk_ids_TK=ids_TK, topk_scores_TK=scores_TK.requires_grad_(),
        weights=weights if weights is not None else make_weights(cfg), grad_y_TH=grad_y_TH,
    )


def first_hop_chunks(
    tokens: int, experts: int, top_k: int, ep: int, chunks: int, gen: torch.Generator
) -> list[tuple[Tensor, list[int]]]:
    """The first hop's chunks as the ring forms them, for kernel probes at a hop's shapes (docs/bench/): uniform
    random top-k routing of ``tokens`` over ``experts``, pairs sorted by expert (stable), rank 0's ``experts / ep``
    experts split into ``chunks`` runs of experts; per chunk its pairs' tokens ``tok_S`` and its rows per expert."""
    ids_TK = torch.rand(tokens, experts, device=gen.device, generator=gen).topk(top_k, dim=1).indices
    flat = ids_TK.flatten()
    order = torch.sort(flat, stable=True).indices
    per_rank = experts // ep
    counts = torch.bincount(flat, minlength=experts)[:per_rank].tolist()
    edges = [round(c * per_rank / chunks) for c in range(chunks + 1)]
    out, start = [], 0
    for a, b in zip(edges, edges[1:]):
        rows = sum(counts[a:b])
        out.append((order[start : start + rows] // top_k, counts[a:b]))
        start += rows
    return out

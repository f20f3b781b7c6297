"""Per-rank inputs of every-rank-real runs (``bench.rank_threads``): each rank's tokens, routing and experts.

    inputs = rank_inputs(cfg, rank, Skew("hot_rank", 0.5))

Routers (``Skew.kind``):

- ``qwen3``: the Qwen3 router (softmax of ``x @ gate.T``, top-k, renormalized) over this rank's own tokens;
- ``hot_expert``: every pair drawn without replacement from expert popularities where the last expert weighs
  ``strength`` times the others (``strength=inf``: every token's first choice, which is the most one expert can
  hold with K distinct experts per token: 1/K of all pairs);
- ``hot_rank``: the last rank's experts together draw ``share`` of the popularity (a rank of popular experts);
- ``zipf``: popularities ``1 / (i + 1)^share`` over a seeded permutation of the experts.

Scores: a softmax over the K slots of seeded normal logits. ``uneven=True`` spreads the tokens per rank from a
quarter to 1.75x of ``cfg.tokens`` (mean ``cfg.tokens``; rank 0 the fewest). Every tensor is seeded by
``(cfg.seed, rank)``; rank ``r``'s experts are ``r * E_l ... (r + 1) * E_l - 1`` of ``moe_weights(cfg.seed)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from relay_compile.bench.configs import LayerConfig
from relay_compile.bench.inputs import LayerInputs
from relay_compile.reference import moe_weights, qwen3_route

__all__ = ["KINDS", "Skew", "pair_shares", "rank_inputs", "rank_tokens"]

KINDS = ("qwen3", "hot_expert", "hot_rank", "zipf")


@dataclass(frozen=True)
class Skew:
    """A router (module docstring) and whether token counts differ across ranks."""

    kind: str = "qwen3"
    share: float = 0.0  # hot_expert: the hot expert's weight relative to one other; hot_rank: the rank's
    # share of the popularity; zipf: the exponent
    uneven: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Skew: kind={self.kind!r} is not one of {KINDS}")

    def label(self) -> str:
        share = "" if self.kind == "qwen3" else f" {self.share:g}"
        return f"{self.kind}{share}{' uneven' if self.uneven else ''}"


def rank_tokens(cfg: LayerConfig, rank: int, uneven: bool) -> int:
    """Rank ``rank``'s token count (module docstring), a multiple of 16."""
    if not uneven or cfg.ep == 1:
        return cfg.tokens
    scale = 0.25 + 1.5 * rank / (cfg.ep - 1)
    return max(16, int(cfg.tokens * scale) // 16 * 16)


def _popularity(cfg: LayerConfig, skew: Skew) -> Tensor:
    e = cfg.experts
    p = torch.ones(e, dtype=torch.float64)
    if skew.kind == "hot_expert":
        p[-1] = skew.share if math.isfinite(skew.share) else 1.0
    elif skew.kind == "hot_rank":
        hot = slice(e - cfg.experts_per_rank, e)
        p[hot] = skew.share / cfg.experts_per_rank
        p[: e - cfg.experts_per_rank] = (1 - skew.share) / (e - cfg.experts_per_rank)
    elif skew.kind == "zipf":
        order = torch.randperm(e, generator=torch.Generator().manual_seed(cfg.seed))  # alike on every rank
        p[order] = 1.0 / torch.arange(1, e + 1, dtype=torch.float64) ** skew.share
    return p / p.sum()


def _route(cfg: LayerConfig, skew: Skew, x_TH: Tensor, seed: int) -> tuple[Tensor, Tensor]:
    t, k = x_TH.shape[0], cfg.top_k
    if skew.kind == "qwen3":
        gate_EH = moe_weights(cfg.seed, cfg.hidden, 1, cfg.experts, experts=range(1), dtype=x_TH.dtype,
                              device=x_TH.device)["gate"]
        with torch.no_grad():
            return qwen3_route(x_TH, gate_EH, k)
    cpu = torch.Generator().manual_seed(seed)
    p = _popularity(cfg, skew).expand(t, -1)
    ids_TK = torch.multinomial(p, k, replacement=False, generator=cpu)
    if skew.kind == "hot_expert" and not math.isfinite(skew.share):
        hot = cfg.experts - 1
        has = (ids_TK == hot).any(1)
        ids_TK[~has, 0] = hot  # every token's first choice; its K slots stay distinct
    scores_TK = torch.softmax(torch.randn(t, k, generator=cpu, dtype=torch.float32), dim=1)
    return ids_TK.to(x_TH.device), scores_TK.to(device=x_TH.device, dtype=x_TH.dtype)


def rank_inputs(cfg: LayerConfig, rank: int, skew: Skew = Skew()) -> LayerInputs:
    """Rank ``rank``'s tokens, routing, experts and output gradient (module docstring)."""
    gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed * 1009 + rank + 1)
    t, dt = rank_tokens(cfg, rank, skew.uneven), cfg.torch_dtype
    x_TH = torch.randn(t, cfg.hidden, generator=gen, device=cfg.device, dtype=dt)
    ids_TK, scores_TK = _route(cfg, skew, x_TH, cfg.seed * 1009 + rank + 7)
    grad_y_TH = torch.randn(t, cfg.hidden, generator=gen, device=cfg.device, dtype=dt)
    e_l = cfg.experts_per_rank
    w = moe_weights(cfg.seed, cfg.hidden, cfg.ffn, cfg.experts, experts=range(rank * e_l, (rank + 1) * e_l),
                    dtype=dt, device=cfg.device)
    return LayerInputs(x_TH=x_TH.requires_grad_(), topk_ids_TK=ids_TK, topk_scores_TK=scores_TK.requires_grad_(),
                       weights=[w["w1"].requires_grad_(), w["w2"].requires_grad_(), w["w3"].requires_grad_()],
                       grad_y_TH=grad_y_TH)


def pair_shares(cfg: LayerConfig, ids: list[Tensor]) -> tuple[float, float]:
    """Of all ranks' pairs (``ids``: every rank's ``(T, K)``): the largest share on one expert, on one rank."""
    counts_E = sum(torch.bincount(i.flatten().cpu(), minlength=cfg.experts) for i in ids)
    total = float(counts_E.sum())
    per_rank = counts_E.view(cfg.ep, -1).sum(1)
    return float(counts_E.max()) / total, float(per_rank.max()) / total

"""torchtitan 0.3.0's ``MoE`` (router + ``RoutedExperts`` with ``AllToAllTokenDispatcher``) on CPU over gloo.

The expert parallel group is the whole world. How it is built comes from notes/capture_torchtitan.py; what it
traces to is in notes/torchtitan_graph.md. Its ``GroupedExperts`` computes in bf16 even for fp32 parameters.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn


def torchtitan_available() -> bool:
    """torchtitan imports ``triton`` at import time even on CPU (minimal_async_ep/kernels.py)."""
    return all(importlib.util.find_spec(m) is not None for m in ("torchtitan", "triton", "spmd_types"))


def build_torchtitan_moe(
    world: int, *, dim: int = 16, hidden: int = 8, num_experts: int = 8, top_k: int = 2, seed: int = 0
) -> nn.Module:
    """A parallelized ``torchtitan.models.common.moe.MoE`` whose experts are ``DTensor(Shard(0))`` over an
    "ep" mesh spanning the ``world`` ranks of the default process group (already initialized).

    Every rank builds the full weights from ``seed`` before sharding, so ranks agree.
    """
    from relay_compile.bench.torchtitan_rows import titan_ep_moe

    def init_normal(p: torch.Tensor) -> None:
        torch.nn.init.normal_(p, std=0.2)

    pdims, cfg = titan_ep_moe(world, "cpu", dim=dim, hidden=hidden, num_experts=num_experts, top_k=top_k,
                              init=init_normal)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)  # the same full weights on every rank (distribute_tensor also broadcasts)
    moe = cfg.build()
    moe.init_states()
    torch.random.set_rng_state(state)
    moe.parallelize(pdims)  # w1/w2/w3 -> DTensor Shard(0) on the "ep" mesh; wires the dispatcher's ep_mesh
    return moe

"""torchtitan 0.3.0's ``MoE`` (router + ``RoutedExperts`` with ``AllToAllTokenDispatcher``) on CPU over gloo.

The expert parallel group is the whole world. How it is built comes from notes/capture_torchtitan.py; what it
traces to is in notes/torchtitan_graph.md. Its ``GroupedExperts`` computes in bf16 even for fp32 parameters.
"""

from __future__ import annotations

import importlib.util
import unittest.mock

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
    import spmd_types as spmd
    import torchtitan.distributed.parallel_dims as pd
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.common.config_utils import (
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config

    # torchtitan reads its SPMD backend from this module global (default "spmd_types", which needs its own
    # runtime): "partial_dtensor" keeps plain DTensor parameters. Set for the whole process (a test child).
    dist_utils.set_spmd_backend("partial_dtensor")
    pdims = ParallelDims(
        dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=world, world_size=world, spmd_backend="partial_dtensor"
    )
    # ParallelDims.build_mesh calls init_device_mesh with this module-level name (default "cuda").
    with unittest.mock.patch.object(pd, "device_type", "cpu"):
        pdims.build_mesh()

    def init_normal(p: torch.Tensor) -> None:
        torch.nn.init.normal_(p, std=0.2)

    cfg = make_moe_config(
        num_experts=num_experts,
        router=make_router_config(
            dim=dim, num_experts=num_experts, top_k=top_k, score_func="softmax",
            gate_param_init={"weight": init_normal},
        ),
        routed_experts=make_routed_experts_config(
            dim=dim, hidden_dim=hidden, num_experts=num_experts, top_k=top_k,
            param_init={"w1_EFD": init_normal, "w2_EDF": init_normal, "w3_EFD": init_normal},
            comm_backend="standard",  # -> AllToAllTokenDispatcher
        ),
        load_balance_coeff=None,  # no expert_bias_E buffer
    )
    set_moe_sharding_config(
        cfg, enable_ep=True, enable_sp=False,
        expert_param_layout={"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)},
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)  # the same full weights on every rank (distribute_tensor also broadcasts)
    moe = cfg.build()
    moe.init_states()
    torch.random.set_rng_state(state)
    moe.parallelize(pdims)  # w1/w2/w3 -> DTensor Shard(0) on the "ep" mesh; wires the dispatcher's ep_mesh
    return moe

"""torchtitan 0.3.0's MoE layer as bench rows: eager (its own all-to-all dispatcher) and under ``torch.compile``.

    standin_world(cfg.ep)                                  # torchtitan's mesh code builds on this world
    result = measure_layer(cfg, opts, [*a2a_and_ring_rows, *torchtitan_rows()])

What runs: torchtitan's ``RoutedExperts`` (``AllToAllTokenDispatcher`` + ``GroupedExperts``: the counts and token
all-to-alls, its permutes, grouped GEMMs and the scatter-add combine) of a ``MoE`` built from torchtitan's own
config helpers and parallelized by its own code (``ParallelDims.build_mesh``, ``MoE.parallelize``: experts become
``DTensor(Shard(0))`` on the "ep" mesh) on the stand-in world (``standin_group.standin_world``), this process
rank 0 of ``cfg.ep`` ranks. Its router is left out: every row of the table routes the bench's pairs
(``LayerInputs.topk_ids_TK``, ``topk_scores_TK``) on the bench's experts (copied into the module's local shards at
the first call), so the rows compute the same function. The one-hot count of tokens per expert is computed as
``MoE.forward`` computes it, inside the row.

Parameters are in the bench's dtype (bf16 on the device: torchtitan's ``GroupedExperts`` computes in bf16, and
``.bfloat16()`` of bf16 weights is no cast). Its weight gradients land in the module's parameters; the row's
layer clears them before each step (``clear_grads``), as the other rows' leaves are cleared.

Two settings torchtitan needs outside its trainer (as in tests/models/torchtitan_moe.py): the SPMD backend
``partial_dtensor`` (the default ``spmd_types`` needs its own runtime), and on the CPU ``ParallelDims``'s module
level ``device_type`` (``"cuda"`` wherever CUDA is available) pointed at the configuration's device. On torch
2.11 (the device machine's) one more: ``torch.compiler._is_non_strict_tracing``, which torchtitan 0.3.0 calls and
2.11 lacks, answers False.

Legend: T tokens per rank, H hidden, F expert FFN width, E experts, K top-k, N EP size, E_l = E / N.
"""

from __future__ import annotations

import importlib.util
import unittest.mock
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from relay_compile.bench.configs import LayerConfig
from relay_compile.bench.rows import LayerFn, RowBuilder, RowSkipped, RowSpec
from relay_compile.bench.standin_group import StandinGroup

# Row names.
TITAN_EAGER = "torchtitan eager"
TITAN_RELAYMOE = "torchtitan relaymoe backend"
TITAN_INDUCTOR = "torchtitan inductor"


def torchtitan_available() -> bool:
    """torchtitan imports ``triton`` at import time even on CPU, and ``spmd_types`` everywhere."""
    return all(importlib.util.find_spec(m) is not None for m in ("torchtitan", "triton", "spmd_types"))


class TitanRoutedExperts(nn.Module):
    """``forward(x_TH, topk_ids_TK, topk_scores_TK) -> y_TH``: torchtitan's ``RoutedExperts`` on given routing.

    ``routed`` is a parallelized ``MoE``'s ``routed_experts``; the counts are ``MoE.forward``'s.
    """

    def __init__(self, routed: nn.Module, num_experts: int) -> None:
        super().__init__()
        self.routed = routed
        self.num_experts = num_experts

    def forward(self, x_TH: Tensor, topk_ids_TK: Tensor, topk_scores_TK: Tensor) -> Tensor:
        T, H = x_TH.shape
        # MoE.forward's one-hot routing map, summed over tokens: (E,) counts of this rank's pairs per expert.
        routing_map_TE = torch.zeros(T, self.num_experts, dtype=torch.bool, device=x_TH.device)
        counts_E = routing_map_TE.scatter_(-1, topk_ids_TK, True).sum(dim=0)
        y_BLD = self.routed(x_TH.view(1, T, H), topk_scores_TK.unsqueeze(0), topk_ids_TK.unsqueeze(0), counts_E)
        return y_BLD.view(T, H)


def titan_ep_moe(
    world: int, device_type: str, *, dim: int, hidden: int, num_experts: int, top_k: int,
    init: Callable[[Tensor], None],
) -> tuple[Any, Any]:
    """torchtitan's EP setup over the running world of ``world`` ranks, as its trainer makes it: the
    ``ParallelDims`` (mesh built) and a ``MoE`` config with a softmax router, ``AllToAllTokenDispatcher`` and the
    experts sharded over "ep" (``init`` initializes every parameter). Build, then ``parallelize(pdims)``.
    """
    import spmd_types as spmd  # type: ignore[import-untyped]
    import torchtitan.distributed.parallel_dims as parallel_dims  # type: ignore[import-untyped]
    from torchtitan.distributed import utils as dist_utils  # type: ignore[import-untyped]
    from torchtitan.models.common.config_utils import (  # type: ignore[import-untyped]
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config  # type: ignore[import-untyped]

    # torchtitan reads its SPMD backend from this module global (default "spmd_types", which needs its own
    # runtime): "partial_dtensor" keeps plain DTensor parameters. Process-wide, as its trainer sets it.
    dist_utils.set_spmd_backend("partial_dtensor")
    pdims = parallel_dims.ParallelDims(
        dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=world, world_size=world, spmd_backend="partial_dtensor"
    )
    # ParallelDims.build_mesh calls init_device_mesh with this module-level name ("cuda" wherever CUDA exists).
    with unittest.mock.patch.object(parallel_dims, "device_type", device_type):
        pdims.build_mesh()
    moe_cfg = make_moe_config(
        num_experts=num_experts,
        router=make_router_config(dim=dim, num_experts=num_experts, top_k=top_k, score_func="softmax",
                                  gate_param_init={"weight": init}),
        routed_experts=make_routed_experts_config(
            dim=dim, hidden_dim=hidden, num_experts=num_experts, top_k=top_k,
            param_init={"w1_EFD": init, "w2_EDF": init, "w3_EFD": init},
            comm_backend="standard",  # -> AllToAllTokenDispatcher
        ),
        load_balance_coeff=None,  # no expert_bias_E buffer
    )
    set_moe_sharding_config(
        moe_cfg, enable_ep=True, enable_sp=False,
        expert_param_layout={"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)},
    )
    return pdims, moe_cfg


def build_titan_experts(cfg: LayerConfig) -> TitanRoutedExperts:
    """torchtitan's MoE for ``cfg`` on the running stand-in world of ``cfg.ep`` ranks, parallelized by its own code.

    Raises:
        RowSkipped: torchtitan is not installed, or the world is not a stand-in world of ``cfg.ep`` ranks.
    """
    if not torchtitan_available():
        raise RowSkipped("torchtitan, spmd_types or triton is not installed")
    world = dist.group.WORLD if dist.is_initialized() else None
    if not isinstance(world, StandinGroup) or dist.get_world_size() != cfg.ep:
        raise RowSkipped(
            f"torchtitan rows need the stand-in world of {cfg.ep} ranks its mesh code builds on: call "
            f"relay_compile.bench.standin_world({cfg.ep}) before measure_layer"
        )
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):
        # torchtitan 0.3.0's dispatcher asks it (torch 2.13) whether make_fx traces, to pick functional
        # collectives; torch 2.11 (the device machine's) has neither the function nor that tracing: False.
        torch.compiler._is_non_strict_tracing = lambda: False  # type: ignore[attr-defined]
    device = torch.device(cfg.device)

    def no_init(p: Tensor) -> None:  # the bench's experts are copied in at the first call
        pass

    pdims, moe_cfg = titan_ep_moe(cfg.ep, device.type, dim=cfg.hidden, hidden=cfg.ffn, num_experts=cfg.experts,
                                  top_k=cfg.top_k, init=no_init)
    with torch.device("meta"):  # the full (E, F, H) experts exist only while parallelize shards them
        moe = moe_cfg.build()
    moe.to_empty(device=device)
    moe.to(cfg.torch_dtype)
    moe.parallelize(pdims)  # w1/w2/w3 -> DTensor Shard(0) on the "ep" mesh; wires the dispatcher's ep_mesh
    return TitanRoutedExperts(moe.routed_experts, cfg.experts)


def expert_params(layer: TitanRoutedExperts) -> list[Tensor]:
    """``w1_EFD, w2_EDF, w3_EFD``: the layouts of the bench's ``w1 (E_l, F, H), w2 (E_l, H, F), w3``."""
    inner: Any = layer.routed.inner_experts
    return [inner.w1_EFD, inner.w2_EDF, inner.w3_EFD]


class _TitanLayer:
    """A ``LayerFn`` over a torchtitan layer (eager or compiled); ``clear_grads`` drops its parameters' grads."""

    def __init__(self, layer: TitanRoutedExperts, run: Any) -> None:
        self.layer, self.run = layer, run
        self.loaded = False

    def __call__(self, x: Tensor, ids: Tensor, scores: Tensor, w1: Tensor, w2: Tensor, w3: Tensor) -> Tensor:
        if not self.loaded:  # the bench's experts, once: every row computes on the same weights
            with torch.no_grad():
                for p, w in zip(expert_params(self.layer), (w1, w2, w3), strict=True):
                    local = p.to_local() if hasattr(p, "to_local") else p
                    assert local.shape == w.shape, f"torchtitan row: expert shard {tuple(local.shape)} != {tuple(w.shape)}"
                    local.copy_(w)
            self.loaded = True
        return self.run(x, ids, scores)

    def clear_grads(self) -> None:
        self.layer.zero_grad(set_to_none=True)


def titan_builder(backend: str | None = None) -> RowBuilder:
    """A builder of torchtitan's layer, eager (``backend`` None) or ``torch.compile(layer, backend=backend)``.

    Compiled rows compile with static shapes (``dynamic=False``) and the default options; inductor needs the
    two Dynamo settings that make torchtitan's dispatcher one graph (the relaymoe backend sets them itself).
    """

    def build(cfg: LayerConfig, group: Any) -> LayerFn:
        layer = build_titan_experts(cfg)
        if backend is None:
            return _TitanLayer(layer, layer)
        compiled = torch.compile(layer, backend=backend, dynamic=False)

        def run(*args: Tensor) -> Tensor:
            # torchtitan's split sizes are .tolist() of device tensors and its permute repeat_interleaves them:
            # one graph needs unbacked SymInts for both (set here for inductor; relaymoe sets them itself).
            with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
                return compiled(*args)

        return _TitanLayer(layer, run)

    return build


def torchtitan_rows(*, eager: bool = True, relaymoe: bool = True, inductor: bool = False) -> list[RowSpec]:
    """torchtitan's rows: eager (its all-to-all dispatcher), through the relaymoe backend, under inductor."""
    rows = []
    if eager:
        rows.append(RowSpec(name=TITAN_EAGER, build=titan_builder(), kind="a2a",
                            note="torchtitan 0.3.0 RoutedExperts, AllToAllTokenDispatcher, eager"))
    if relaymoe:
        rows.append(RowSpec(name=TITAN_RELAYMOE, build=titan_builder("relaymoe"), kind="ring", compiles=True,
                            note="torch.compile(torchtitan RoutedExperts, backend='relaymoe'), default options"))
    if inductor:
        rows.append(RowSpec(name=TITAN_INDUCTOR, build=titan_builder("inductor"), kind="a2a", compiles=True,
                            note="torch.compile(torchtitan RoutedExperts), inductor"))
    return rows

"""Real third-party MoE layers, built as their users build them, unmodified: DeepSpeed's ``MoE`` and Hugging Face
transformers' sparse MoE blocks under its expert-parallel plan (``apply_expert_parallelism``, all-to-all).

Every builder runs on a rank whose default process group (gloo) is up; the layers' expert weights are drawn
per global expert, so every rank holds its own experts and the eager layer is the reference the compiled one
is checked against. Call signatures return ``(layer, forward)`` where ``forward(x)`` gives the block's
output tensor and an auxiliary loss (0 where the package has none).
"""

from __future__ import annotations

import datetime
import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

Forward = Callable[[Tensor], tuple[Tensor, Tensor]]


def available(package: str) -> bool:
    try:
        importlib.import_module(package)
    except Exception:  # noqa: BLE001 -- a package that does not import (missing, or a broken install) is absent
        return False
    return True


def _draw(params: list[nn.Parameter], seed: int, scale: float = 0.3) -> None:
    with torch.no_grad():
        for i, p in enumerate(params):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed * 1000 + i)) * scale)


# ----------------------------------------------------------------------------------------------------------
# DeepSpeed
# ----------------------------------------------------------------------------------------------------------


def deepspeed_moe(hidden: int, ffn: int, num_experts: int, **moe_kwargs: Any) -> tuple[nn.Module, Forward]:
    """``deepspeed.moe.layer.MoE(hidden, expert=Sequential(Linear, GELU, Linear), num_experts, ep_size=world,
    **moe_kwargs)`` with its expert-parallel groups set (``set_deepspeed_parallelism``, what
    ``deepspeed.initialize`` does for it)."""
    import deepspeed
    from deepspeed.moe.layer import MoE

    world, rank = dist.get_world_size(), dist.get_rank()
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=20))
    torch.manual_seed(0)  # the gate and (with use_residual) the dense MLP: the same on every rank
    expert = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
    layer = MoE(hidden, expert=expert, num_experts=num_experts, ep_size=world, **moe_kwargs)
    layer.set_deepspeed_parallelism()
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    for i, e in enumerate(experts):
        _draw(list(e.parameters()), seed=1 + rank * len(experts) + i)
    _draw(list(layer.deepspeed_moe.gate.parameters()), seed=10_000, scale=1.0)

    def forward(x: Tensor) -> tuple[Tensor, Tensor]:
        y, l_aux, _ = layer(x)
        return y, l_aux

    return layer, forward


# ----------------------------------------------------------------------------------------------------------
# Hugging Face transformers
# ----------------------------------------------------------------------------------------------------------

# model_type -> (config class, sparse MoE block class); each config's ``base_model_ep_plan`` names the block's
# experts "ep_dispatch_experts" (transformers 5.24: 70 model types share the plan and its AllToAllEP).
HF_BLOCKS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock"),
    "mixtral": ("MixtralConfig", "MixtralSparseMoeBlock"),
}


def hf_moe_block(model_type: str, hidden: int, ffn: int, num_experts: int, top_k: int) -> tuple[nn.Module, Forward]:
    """The model type's sparse MoE block from a small config, ``_experts_implementation="grouped_mm"``, after
    ``apply_expert_parallelism(block, ep_mesh, tp_mesh, <the config's plan for the block>, "all_to_all")``."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    config_name, block_name = HF_BLOCKS[model_type]
    configs = importlib.import_module(f"transformers.models.{model_type}.configuration_{model_type}")
    models = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    config = getattr(configs, config_name)(
        hidden_size=hidden, moe_intermediate_size=ffn, intermediate_size=ffn, num_experts=num_experts,
        num_local_experts=num_experts, num_experts_per_tok=top_k,
    )
    config._experts_implementation = "grouped_mm"
    block = getattr(models, block_name)(config)
    _draw(list(block.parameters()), seed=7)  # the full weights, the same on every rank: EP keeps this rank's shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("ep", "tp"))
    prefix = "layers.*.mlp."
    plan = {k[len(prefix):]: v for k, v in type(config).base_model_ep_plan.items() if k.startswith(prefix)}
    apply_expert_parallelism(block, mesh["ep"], mesh["tp"], plan, ep_implementation="all_to_all")

    def forward(x: Tensor) -> tuple[Tensor, Tensor]:
        out = block(x)
        return (out[0] if isinstance(out, tuple) else out), x.new_zeros(())

    return block, forward

"""Modeled link time of one training step (simulated): the stand-in group moves no data over a link.

Per MoE layer, from ``relay_compile.bench.link_model`` (its docstring gives the model), summed over layers:

    a2a:   2 all-to-alls per forward of the block (dispatch, combine) and 2 in backward; a row that replays the
           block in backward (full or MoE checkpointing) runs its forward twice: 6 instead of 4
    ring:  N-1 forward and N backward transfers per block of the smaller per-hop volume (what routing "auto"
           picks); the partitioner never replays the ring op (its backward needs only its inputs)

The total is the transfers back to back: for a2a the time a step adds on a real link; for the ring an upper
bound (it overlaps each transfer with a hop's compute). Only the MoE blocks communicate on the EP group here;
the gradient all-reduce of replicated parameters (data parallelism) is left out of every row alike.
"""

from __future__ import annotations

from relay_compile.bench.configs import LayerConfig
from relay_compile.bench.full_model.model import FullModelConfig
from relay_compile.bench.full_model.policies import Policy
from relay_compile.bench.link_model import link_model
from relay_compile.bench.rows import RowSpec, build_eager_a2a

__all__ = ["step_link_ms"]


def _layer(cfg: FullModelConfig, tokens: int) -> LayerConfig:
    return LayerConfig(name=cfg.name, hidden=cfg.hidden, ffn=cfg.ffn, experts=cfg.experts, top_k=cfg.top_k,
                       tokens=tokens, ep=cfg.ep, dtype=cfg.dtype, device=cfg.device)


def step_link_ms(cfg: FullModelConfig, policy: Policy, tokens: int, gbps: float) -> float:
    """Modeled milliseconds of link transfers in one step of ``policy`` at ``tokens`` per rank (module docstring)."""
    layer = _layer(cfg, tokens)
    if policy.kind == "a2a":
        spec = RowSpec(name=policy.name, build=build_eager_a2a, kind="a2a")
        per_block = link_model(layer, spec, 0.0, 0.0, gbps).link_ms * (2 * policy.moe_forwards + 2) / 4
    else:
        per_block = min(
            link_model(layer, RowSpec(name=policy.name, build=build_eager_a2a, kind="ring", routing=routing), 0.0,
                       0.0, gbps).link_ms
            for routing in ("expert", "token")
        )
    return cfg.layers * per_block

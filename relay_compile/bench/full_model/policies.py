"""The rows of the full-model benchmark: how each runs a layer (``Policy``), and the layer runners they build.

A row is a backend (eager all-to-all; the a2a model under torch.compile with the inner compiler, inductor on a
GPU; ``backend="relaymoe"``) under a recompute policy:

    none        save everything autograd (or the compiled graph's partitioner, at its default) saves
    full        ``torch.utils.checkpoint`` of every decoder layer: keep each layer's input, replay it in backward
    moe         ``torch.utils.checkpoint`` of the MoE block of every layer (attention keeps its activations)
                (under relaymoe the ring is rewritten inside the checkpoint and its output is saved, so the
                checkpoint replays the rest of the layer, not the ring)
    budget      the partitioner's activation memory budget (``torch._functorch.config.activation_memory_budget``,
                the backend's ``activation_memory_budget`` option), chosen per step from the memory budget
                (``budget.BudgetChooser``): save what fits, recompute the rest

Compiled rows compile one function, ``_layer_forward(layer, x)``, shared by every layer (Dynamo inlines the
module: its parameters are graph inputs, so the eight layers reuse one graph), with the token dimension
marked dynamic (one compile for every length), or with static shapes (``--static-shapes``: one compile per
length, as a run of one fixed length compiles).

Legend: T tokens per rank, H hidden.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from relay_compile.backend import relaymoe_backend
from relay_compile.bench.full_model.model import DecoderLayer, LayerRunner

Backend = Literal["eager", "compiled", "relaymoe"]
Recompute = Literal["none", "full", "moe", "budget"]

__all__ = ["A2A_EAGER", "POLICIES", "Policy", "layer_runner"]


@dataclass(frozen=True, kw_only=True)
class Policy:
    """One row: a backend under a recompute policy, and what the link model needs (a2a or ring)."""

    name: str
    backend: Backend
    recompute: Recompute
    note: str = ""

    @property
    def kind(self) -> Literal["a2a", "ring"]:
        return "ring" if self.backend == "relaymoe" else "a2a"

    @property
    def compiles(self) -> bool:
        return self.backend != "eager"

    @property
    def moe_forwards(self) -> int:
        """Forward passes of each MoE block per step: 2 where backward replays it (a2a under full or moe
        checkpointing), else 1 (a checkpointed ring's output is saved: the backend's ``keep_rings_saved``)."""
        return 2 if self.recompute in ("full", "moe") and self.backend != "relaymoe" else 1


A2A_EAGER = "a2a eager"

# In search order: the rows the bars compare first, the compiled a2a row (one more compilation) last.
POLICIES: tuple[Policy, ...] = (
    Policy(name=A2A_EAGER, backend="eager", recompute="none", note="the baseline"),
    Policy(name="a2a + full AC", backend="eager", recompute="full", note="checkpoint every layer"),
    Policy(name="a2a + MoE AC", backend="eager", recompute="moe", note="checkpoint every MoE block"),
    Policy(name="relaymoe", backend="relaymoe", recompute="none", note="ring, default partitioner"),
    Policy(name="relaymoe + budget", backend="relaymoe", recompute="budget",
           note="ring, partitioner budget chosen from the memory budget"),
    Policy(name="relaymoe + full AC", backend="relaymoe", recompute="full",
           note="ring, checkpoint every layer (the ring's output saved, the rest replayed)"),
    Policy(name="relaymoe + MoE AC", backend="relaymoe", recompute="moe",
           note="ring, checkpoint every MoE block (the ring's output saved)"),
    Policy(name="a2a compiled", backend="compiled", recompute="none",
           note="torch.compile with the inner compiler (inductor on GPU), default partitioner"),
)


def _eager(layer: DecoderLayer, x_TH: Tensor) -> Tensor:
    return layer(x_TH)


def _full_checkpoint(layer: DecoderLayer, x_TH: Tensor) -> Tensor:
    return checkpoint(layer, x_TH, use_reentrant=False)


def _moe_checkpoint(layer: DecoderLayer, x_TH: Tensor) -> Tensor:
    return checkpoint(layer.moe_block, layer.attention_block(x_TH), use_reentrant=False)


def _layer_forward(layer: DecoderLayer, x_TH: Tensor) -> Tensor:
    return layer(x_TH)


# What a compiled row compiles, per recompute policy (the checkpoint rows compile the checkpointed forward:
# the backend rewrites the MoE block inside the checkpoint's body).
_COMPILED_BODIES: dict[str, LayerRunner] = {
    "none": _layer_forward, "budget": _layer_forward, "full": _full_checkpoint, "moe": _moe_checkpoint,
}


def _compiled(backend: Callable | str, body: LayerRunner = _layer_forward, static: bool = False) -> LayerRunner:
    """``body`` under ``torch.compile``: the token dimension dynamic from the first call, or (``static``) every
    length compiled for its own size, as a training run of one fixed length compiles it."""
    compiled = torch.compile(body, backend=backend, fullgraph=False, dynamic=False if static else None)

    def run(layer: DecoderLayer, x_TH: Tensor) -> Tensor:
        if not static:
            torch._dynamo.mark_dynamic(x_TH, 0)
        return compiled(layer, x_TH)

    return run


def layer_runner(policy: Policy, *, inner_compiler: str, memory_budget: float | None = None,
                 static_shapes: bool = False) -> LayerRunner:
    """The runner of one row; ``memory_budget`` is the partitioner's fraction (``budget`` rows only).

    ``inner_compiler``: what compiles the graph after the relaymoe rewrite, and the a2a row's backend
    (``inductor`` on a GPU, ``aot_eager`` on the CPU, where it partitions alike). ``static_shapes``: compiled
    rows compile each length for its own size (the backend's cost model then decides at compile time, and a
    region it keeps runs exactly as traced); else one compile serves every length and the ring op decides per
    call.
    """
    if policy.backend == "eager":
        return {"none": _eager, "full": _full_checkpoint, "moe": _moe_checkpoint}[policy.recompute]
    if policy.backend == "compiled":
        return _compiled(inner_compiler, static=static_shapes)
    options = {"inner_compiler": inner_compiler, "activation_memory_budget": memory_budget}
    return _compiled(functools.partial(relaymoe_backend, options=options), _COMPILED_BODIES[policy.recompute],
                     static=static_shapes)

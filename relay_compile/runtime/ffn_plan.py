"""ffn_plan: the record of an expert block recognized as an FFN of experts (``ExpertFFN``) and its weights' roles.

Made by the passes (``passes.ffn_template.match_ffn``, from F's graph), read by the runtime (``lowered_ffn``:
how the region's weights pack into the engine's layout and which activation runs). Data only.

Legend: F expert FFN width, E_l experts per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from relay_compile.experts import Activation

Layout = Literal["out_in", "in_out"]
@dataclass(frozen=True, kw_only=True)
class WeightRole:
    """Where one projection's weights are among the region's weights, and how they are laid out.

    ``stacked``: position of one ``(E_l, a, b)`` tensor used by a grouped GEMM. Otherwise ``per_expert[e]`` is
    ``(position, index)``: local expert ``e`` uses ``weights[position]`` (``index`` None) or
    ``weights[position][index]``. ``layout`` is one expert's matrix: ``"out_in"`` (``nn.Linear``'s ``(out, in)``,
    torchtitan's ``w1 (E, F, H)``) or ``"in_out"``.
    """

    stacked: int | None = None
    per_expert: tuple[tuple[int, int | None], ...] = ()
    layout: Layout = "out_in"

    def positions(self) -> set[int]:
        return {self.stacked} if self.stacked is not None else {p for p, _ in self.per_expert}

    def describe(self) -> str:
        where = f"weights[{self.stacked}] stacked" if self.stacked is not None else (
            "per expert " + ", ".join(f"weights[{p}]" + (f"[{i}]" if i is not None else "") for p, i in self.per_expert)
        )
        return f"{where} ({self.layout})"


@dataclass(frozen=True, kw_only=True)
class BiasRole:
    """Where one projection's biases are: ``stacked``, the position of one tensor holding every local expert's
    bias (``(E_l, F)``, or ``(E_l, 1, F)`` as batched idioms store it); otherwise ``per_expert[e]`` is
    ``(position, index)``: local expert ``e`` adds ``weights[position]`` (``(F,)`` or ``(1, F)``; ``index``
    None) or ``weights[position][index]``."""

    stacked: int | None = None
    per_expert: tuple[tuple[int, int | None], ...] = ()

    def positions(self) -> set[int]:
        return {self.stacked} if self.stacked is not None else {p for p, _ in self.per_expert}

    def describe(self) -> str:
        if self.stacked is not None:
            return f"weights[{self.stacked}] stacked"
        at = (f"weights[{p}]" + (f"[{i}]" if i is not None else "") for p, i in self.per_expert)
        return "per expert " + ", ".join(at)


@dataclass(frozen=True, kw_only=True)
class ExpertFFN:
    """F recognized: ``down(act(gate(x)) * up(x))`` (gated) or ``down(act(gate(x)))`` per row, by expert; each
    projection ``x W^T`` or ``x W^T + b`` (its bias role, None when it has none)."""

    activation: Activation
    gate: WeightRole  # w1; with ``fused_gate_up``, the (2F, H) projection whose halves are [gate, up]
    up: WeightRole | None  # w3 (gated activations with separate projections)
    down: WeightRole  # w2
    fused_gate_up: bool
    compute_dtype: torch.dtype | None  # F casts rows and weights to this before its GEMMs (None: no cast)
    gate_bias: BiasRole | None = None  # b1; with ``fused_gate_up``, the (2F,) bias of the fused projection
    up_bias: BiasRole | None = None  # b3
    down_bias: BiasRole | None = None  # b2

    def roles(self) -> list[WeightRole | BiasRole]:
        return [r for r in (self.gate, self.up, self.down, *self.biases()) if r is not None]

    def biases(self) -> list[BiasRole]:
        return [b for b in (self.gate_bias, self.up_bias, self.down_bias) if b is not None]

    def describe(self) -> str:
        gate = f"gate{'+up' if self.fused_gate_up else ''}"
        with_bias = f" with bias ({', '.join(self._bias_names())})" if self.biases() else ""
        parts = [f"{self.activation} experts{with_bias}", f"{gate} {self.gate.describe()}"]
        if self.up is not None:
            parts.append(f"up {self.up.describe()}")
        parts.append(f"down {self.down.describe()}")
        for name, bias in ((gate, self.gate_bias), ("up", self.up_bias), ("down", self.down_bias)):
            if bias is not None:
                parts.append(f"{name} bias {bias.describe()}")
        if self.compute_dtype is not None:
            parts.append(f"computed in {self.compute_dtype}")
        return ", ".join(parts)

    def _bias_names(self) -> list[str]:
        names = ("gate+up" if self.fused_gate_up else "gate", "up", "down")
        return [n for n, b in zip(names, (self.gate_bias, self.up_bias, self.down_bias)) if b is not None]

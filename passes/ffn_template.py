"""ffn_template: the FFN templates a recognized expert block's per-row program must match, and their record.

``expert_block`` interprets F's graph into the content expression of one output row (``Expr``); ``match_ffn``
matches it against

    down( act(gate(x)) [* up(x)] )        separate gate/up projections, or one fused projection chunked in two
    down( relu(gate(x)) ** 2 )            squared ReLU

with ``act`` one of silu, gelu (exact or tanh), relu, each projection ``x W_e^T [+ b_e]``, and gives an
``ExpertFFN``: the activation, where each projection's weights and biases are among the region's weights (one
stacked tensor, or one tensor or slice per local expert), their layout, and the dtype F computes in.

Legend: F expert FFN width, E_l experts per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

import torch

from relay_compile.experts import ACTIVATIONS, Activation

Layout = Literal["out_in", "in_out"]
# One row's content: ("x",) | ("cast", dtype, e) | ("gemm", WeightKey, e) | ("bias", BiasKey, e) | ("act", name, e)
# | ("mul", a, b) | ("chunk", i, n, e) | ("square", e) | ("sigmoid", e). Tuples, so that equal programs compare equal.
Expr = tuple


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


class NotAnFFN(Exception):
    """F is not (only) a feed-forward network of experts; the message names the node and why."""




def _placement(where: tuple, experts_per_rank: int) -> tuple[int | None, tuple[tuple[int, int | None], ...]]:
    """``(stacked position, ())`` or ``(None, per_expert)`` of a weight or bias key's ``where``."""
    if where[0] == "stacked":
        return where[1], ()
    by_expert = {e: (pos, index) for _, e, pos, index in where}
    if sorted(by_expert) != list(range(experts_per_rank)):
        raise NotAnFFN(f"the expert loop covers local experts {sorted(by_expert)}, not all {experts_per_rank}")
    positions = {pos for pos, _ in by_expert.values()}
    if len(positions) == 1 and all(index == e for e, (_, index) in by_expert.items()):
        # A loop over w[e] of one stacked weight is that stacked weight: no copy to pack it.
        return positions.pop(), ()
    return None, tuple(by_expert[e] for e in range(experts_per_rank))


def _role(key: tuple, experts_per_rank: int) -> tuple[WeightRole, torch.dtype | None]:
    _, where, layout, dtype = key
    stacked, per_expert = _placement(where, experts_per_rank)
    return WeightRole(stacked=stacked, per_expert=per_expert, layout=layout), dtype


def _bias_role(key: tuple | None, experts_per_rank: int) -> tuple[BiasRole | None, torch.dtype | None]:
    if key is None:
        return None, None
    _, where, dtype = key
    stacked, per_expert = _placement(where, experts_per_rank)
    return BiasRole(stacked=stacked, per_expert=per_expert), dtype


def _projection(e: Expr) -> tuple[tuple, tuple | None, Expr] | None:
    """``(weight key, bias key or None, input)`` of ``x W^T [+ b]``; None if ``e`` is no projection."""
    bias = None
    if e[0] == "bias":
        bias, e = e[1], e[2]
    return (e[1], bias, e[2]) if e[0] == "gemm" else None


def _gated_name(act: str) -> str:
    names = {"silu": "swiglu", "gelu": "geglu", "gelu_tanh": "geglu_tanh"}
    if act not in names:
        raise NotAnFFN(f"gated {act} experts are not supported (gated silu, gelu and gelu-tanh are)")
    return names[act]


def _gating(h: Expr) -> tuple[str, Expr, tuple | None, tuple | None, bool]:
    """``act(gate) * up`` -> ``(gated activation, gate's expression, up key, up bias key, fused)``."""
    acts = [t for t in h[1:] if t[0] == "act"]
    if len(acts) != 1:
        raise NotAnFFN("the gating product multiplies no activation (or two)")
    other = h[2] if h[1] is acts[0] else h[1]
    activation, gate = _gated_name(acts[0][1]), acts[0][2]
    if gate[0] == "chunk" and other[0] == "chunk" and gate[3] == other[3] and (gate[1], other[1]) == (0, 1):
        return activation, gate[3], None, None, True
    up = _projection(other)
    if up is None:
        raise NotAnFFN("the gate's activation is multiplied by something other than a projection")
    gate_proj = _projection(gate)
    if gate_proj is None or gate_proj[2] != up[2]:
        raise NotAnFFN("the gate and up projections read different inputs")
    return activation, gate, up[0], up[1], False


def match_ffn(expr: Expr, experts_per_rank: int) -> ExpertFFN:
    """``down(act(gate(x)) [* up(x)])`` from the output's content expression; each projection maybe biased."""
    if expr[0] == "cast":  # back to the rows' dtype after computing in another one
        expr = expr[2]
    down = _projection(expr)
    if down is None:
        raise NotAnFFN("F's output is not a projection by an expert weight")
    down_key, down_bias, h = down
    up_key: tuple | None = None
    up_bias: tuple | None = None
    fused = False
    if h[0] == "mul":
        activation, gate, up_key, up_bias, fused = _gating(h)
    elif h[0] == "square" and h[1][0] == "act" and h[1][1] == "relu":
        activation, gate = "relu2", h[1][2]
    elif h[0] == "act":
        activation, gate = h[1], h[2]
    else:
        raise NotAnFFN("the down projection's input is not an activation of a projection")
    gated = _projection(gate)
    if gated is None:
        raise NotAnFFN("the activation's input is not a projection by an expert weight")
    gate_key, gate_bias, x_in = gated
    compute = x_in[1] if x_in[0] == "cast" else None
    if (x_in[2] if x_in[0] == "cast" else x_in) != ("x",):
        raise NotAnFFN("the first projection does not read the received rows")
    roles = [_role(k, experts_per_rank) for k in (gate_key, up_key, down_key) if k is not None]
    biases = [_bias_role(k, experts_per_rank) for k in (gate_bias, up_bias, down_bias)]
    dtypes = {dtype for _, dtype in roles} | {dtype for b, dtype in biases if b is not None}
    if dtypes != {compute}:
        raise NotAnFFN(f"rows are computed in {compute} but weights cast to {sorted(map(str, dtypes))}")
    gate_role, *rest = [r for r, _ in roles]
    up_role = rest[0] if up_key is not None else None
    assert activation in ACTIVATIONS, f"expert_block: {activation} is not an engine activation"
    return ExpertFFN(
        activation=cast(Activation, activation), gate=gate_role, up=up_role, down=rest[-1], fused_gate_up=fused,
        compute_dtype=compute, gate_bias=biases[0][0], up_bias=biases[1][0], down_bias=biases[2][0],
    )

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

from typing import cast

import torch

from relay_compile.experts import ACTIVATIONS, Activation
from relay_compile.runtime.ffn_plan import BiasRole, ExpertFFN, WeightRole

# One row's content: ("x",) | ("cast", dtype, e) | ("gemm", WeightKey, e) | ("bias", BiasKey, e) | ("act", name, e)
# | ("mul", a, b) | ("chunk", i, n, e) | ("square", e) | ("sigmoid", e). Tuples, so that equal programs compare equal.
Expr = tuple


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

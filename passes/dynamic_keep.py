"""dynamic_keep: regions whose token count is dynamic, kept or run as rings per call.

A region with a static token count is kept at compile time where the cost model keeps it
(``rewrite.kept_at_compile_time``): it then runs as traced, at the all-to-all's time and memory. A region
whose token count T is dynamic (``dynamic=True``, ``mark_dynamic``, a recompile after T changed) cannot be
decided once: T may cross the cost model's threshold from call to call. Such a graph is compiled twice, once
with its regions rewritten into ring ops and once with them kept, and ``runtime.token_switch.TokenSwitch``
picks one per call from every rank's agreed T. Without this the ring op runs small calls through its own
all-to-all path, which recomputes its experts in backward (1.4-1.7x a2a eager at 4096-32768 tokens).

Contract:
    ``plan_switch`` reads a graph and its matched regions before any rewrite. It returns a ``SwitchPlan`` when
    at least one region is ``switchable`` and every switchable region reads the same T, which can be computed
    from the graph's inputs (a SymInt input or a dimension of an input tensor). Otherwise it returns the
    reason there is none. The plan reads T from a call's arguments and says whether the cost model keeps every
    switchable region at a given agreed T. The rule is ``choose`` with the largest T of the group, the rule the
    compile-time keep applies to a static T: the ring against the traced all-to-all the kept variant runs (the
    ring variant's op then weighs the ring against its own all-to-all path, ``kept="op"``, which keeps less).
    Nothing in the graph changes.

Legend: T tokens per rank.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch import Tensor

from relay_compile.passes.expert_lowering import recognized_ffn
from relay_compile.passes.fx_nodes import node_value
from relay_compile.passes.region import Region
from relay_compile.runtime import cost_model
from relay_compile.runtime.block_shape import BlockShape, owner_options
from relay_compile.runtime.cost_model import H200, Calibration, calibration_for, choose
from relay_compile.runtime.ring_options import RingOptions
from relay_compile.runtime.transport import group_link_gbps

# The largest T searched for a region's threshold (the report's ``ring_from``), and the grid searched first:
# powers of two and their midpoints (1, 2, 3, 4, 6, 8, 12, ...).
_MAX_TOKENS = 1 << 24
_GRID = sorted({*(1 << k for k in range(25)), *(3 << k for k in range(23))})


def _tokens_expr(region: Region) -> sympy.Expr | None:
    """The region's T as a SymPy expression of the graph's symbols; None where T is static or unknown."""
    x = node_value(region.x)
    if not isinstance(x, Tensor) or not isinstance(x.shape[0], torch.SymInt):
        return None
    return x.shape[0].node.expr


def switchable(region: Region, options: RingOptions) -> bool:
    """Whether the cost model may keep ``region`` at some calls and not at others: a dynamic T on a device it
    is calibrated for, under ``ring="auto"`` or ``"memory"``."""
    x = node_value(region.x)
    return (options.ring in ("auto", "memory") and _tokens_expr(region) is not None
            and x.device.type in cost_model.CALIBRATED_DEVICES)


def ring_from_tokens(shape: BlockShape, options: RingOptions, grouped: bool = True,
                     cal: Calibration = H200) -> int | None:
    """The smallest T, equal on every rank, from which the cost model runs ``shape`` as a ring (None: at no T up
    to ``_MAX_TOKENS``): the first T of a geometric grid (``_GRID``) that runs a ring, refined by bisection from
    the grid point below it. The choice need not stay a ring above it: the rules' owners per hop step down as hops
    grow (``block_shape.owner_options``; under ``"auto"`` a larger stack takes over where memory allows, not
    always), so a region may be kept again at larger T; ``SwitchPlan.keeps`` decides every
    T itself, this is what the report states and whether a switch is worth compiling. ``grouped``: F lowers onto
    grouped experts (else one owner per hop); ``cal``: the device's constants with the link a hop crosses
    (``cost_model.calibration_for``, ``transport.link_gbps``)."""
    def ring(tokens: int) -> bool:
        return _choice(shape, options, tokens, grouped, cal) != "all_to_all"

    hi = next((t for t in _GRID if ring(t)), None)
    if hi is None:
        return None
    lo = max((t for t in _GRID if t < hi), default=0)  # kept at lo (0: by definition), a ring at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ring(mid) else (mid, hi)
    return hi


def _choice(shape: BlockShape, options: RingOptions, tokens: int, grouped: bool, cal: Calibration) -> str:
    """What ``cost_model.choose`` runs ``shape`` as at ``tokens`` per rank (the compile-time keep's rule)."""
    shape = dataclasses.replace(shape, tokens=tokens)
    owners = owner_options(shape, fp8=options.fp8) if grouped else (1, 1)
    return choose(shape, routing=options.routing, ring=options.ring, cal=cal, owners=owners,
                  max_hop_rows=options.max_hop_rows).execution


@dataclass(frozen=True, kw_only=True)
class SwitchPlan:
    """The regions one switch covers (by their index among the graph's matched regions), their T, and how to
    read T from a call's arguments (``where``: per symbol of T, its placeholder's index and the dimension of that
    tensor input, None where the input is the SymInt itself). ``device``: the tokens' device at trace time, where
    the switch's exchange runs (as the ring op's would)."""

    regions: tuple[int, ...]
    shapes: tuple[BlockShape, ...]
    grouped: tuple[bool, ...]  # per region: F lowers onto grouped experts (``expert_lowering.recognized_ffn``)
    cal: Calibration  # the device's constants, with the link a hop crosses (``transport.link_gbps``)
    tokens: sympy.Expr
    where: tuple[tuple[sympy.Symbol, int, int | None], ...]
    group_name: str
    device: torch.device
    options: RingOptions
    ring_from: int  # the smallest equal T from which some covered region runs as a ring

    def read_tokens(self, args: Sequence[Any]) -> int:
        """T of a call with positional ``args`` (the graph's placeholders, in order)."""
        values = tuple(args[i] if dim is None else args[i].shape[dim] for _, i, dim in self.where)
        return _evaluate(self.tokens, tuple(s for s, _, _ in self.where), values)

    def keeps(self, tokens: int) -> bool:
        """Whether every covered region keeps its all-to-all at an agreed largest T of ``tokens``."""
        return _keeps(self.shapes, self.grouped, self.options, tokens, self.cal)


@functools.lru_cache(maxsize=1024)
def _evaluate(expr: sympy.Expr, symbols: tuple[sympy.Symbol, ...], values: tuple[int, ...]) -> int:
    """``expr`` at ``symbols = values`` (cached: a call's sizes repeat step after step)."""
    value = expr.xreplace({s: sympy.Integer(v) for s, v in zip(symbols, values, strict=True)})
    if not value.is_Integer:
        raise ValueError(f"relaymoe: the token count {expr} at {dict(zip(symbols, values))} is {value}, not an "
                         "integer; pass options={'dynamic_keep': False} and report the model")
    return int(value)


@functools.lru_cache(maxsize=1024)
def _keeps(shapes: tuple[BlockShape, ...], grouped: tuple[bool, ...], options: RingOptions, tokens: int,
           cal: Calibration = H200) -> bool:
    """``SwitchPlan.keeps``, cached per agreed T."""
    return all(_choice(s, options, tokens, g, cal) == "all_to_all" for s, g in zip(shapes, grouped, strict=True))


def _symbol_sources(gm: fx.GraphModule) -> dict[sympy.Symbol, tuple[int, int | None]]:
    """Where each plain symbol of the graph's inputs can be read at a call: its placeholder's index, and the
    dimension of a tensor input (None: the input is the SymInt itself)."""
    where: dict[sympy.Symbol, tuple[int, int | None]] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        value = node_value(node)
        sizes = [(value, None)] if isinstance(value, torch.SymInt) else (
            [(s, d) for d, s in enumerate(value.shape)] if isinstance(value, Tensor) else [])
        for size, dim in sizes:
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                where.setdefault(size.node.expr, (i, dim))
    return where


def plan_switch(gm: fx.GraphModule, regions: Sequence[Region], options: RingOptions) -> SwitchPlan | str:
    """The switch for ``gm``'s switchable ``regions`` (module docstring), or why there is none."""
    chosen = [(i, r) for i, r in enumerate(regions) if switchable(r, options)]
    if not chosen:
        return "no region with a dynamic token count that the cost model may keep"
    exprs = {_tokens_expr(r) for _, r in chosen}
    groups = {r.group_name for _, r in chosen}
    if len(exprs) > 1 or len(groups) > 1:
        return (f"the regions with a dynamic token count differ in it ({', '.join(map(str, exprs))}) or in their "
                "group: each runs as a ring op that decides per call")
    (expr,) = exprs
    where = _symbol_sources(gm)
    missing = expr.free_symbols - where.keys()
    if missing:
        return (f"the token count {expr} has symbols no graph input holds ({', '.join(map(str, missing))}): each "
                "region runs as a ring op that decides per call")
    shapes = tuple(r.block_shape() for _, r in chosen)
    grouped = tuple(recognized_ffn(r) for _, r in chosen)
    group_name = groups.pop()
    device = node_value(chosen[0][1].x).device
    cal = calibration_for(device).with_link(group_link_gbps(group_name, options.link_gbps))
    starts = (ring_from_tokens(s, options, g, cal) for s, g in zip(shapes, grouped, strict=True))
    ring_from = min((t for t in starts if t is not None), default=None)
    if ring_from is None or ring_from <= 1:
        always = "keeps its all-to-all at every" if ring_from is None else "runs a ring at every"
        return (f"the cost model {always} token count up to {_MAX_TOKENS}: one variant would never run, so each "
                "region runs as a ring op that decides per call")
    return SwitchPlan(
        regions=tuple(i for i, _ in chosen), shapes=shapes, grouped=grouped, cal=cal, tokens=expr,
        where=tuple((s, *where[s]) for s in sorted(expr.free_symbols, key=str)), group_name=group_name,
        device=device, options=options, ring_from=ring_from,
    )


"""match: find the all-to-all expert-parallel MoE regions of a Dynamo FX graph (DESIGN.md section 4).

Every a2a EP dispatcher we have seen computes, per rank (names here are roles, never node names):

    order   = argsort(topk_ids.flatten())                    # or sort(...)[1]
    send    = x[order // K]                                  # or x.index_select(0, order // K)
    counts  = exchange(local counts)                         # int a2a, or all_gather (+ constant slice)
    splits  = counts ... .item()                             # unbacked SymInts: per source, or per (source, expert)
    recv    = wait(all_to_all_single(send, splits, ...))     # dispatch
    out     = F(recv, counts, splits, weights)               # everything between the two all-to-alls
    back    = wait(all_to_all_single(out, ..., splits))      # combine
    y       = scatter_add(zeros[T, H], order // K, back * topk_scores.flatten()[order])

Contract:
    Consumes a Dynamo graph (``torch.compile`` with ``capture_scalar_outputs=True``; targets may be the
    ``OpOverloadPacket`` or ``.default`` of ``torch.ops._c10d_functional.*``, and torch 2.11's
    ``_c10d_functional_autograd.all_to_all_single`` whose wait hides in an ``autograd_function_apply``).
    Never mutates it.
    ``find_moe_regions`` returns, in program order of their dispatch, one ``MoERegion`` per dispatch/combine
    pair it understands, and one ``RefusedRegion`` (with a reason, also logged at debug level as
    ``"match: skipped ..."``) per token all-to-all it does not. Matching uses dataflow, op targets, dtypes and
    static shapes only (never node order or names, never data), so every rank decides the same.
    Guarantees for a region: its dataflow is the pattern above, so the block computes
    ``y[t] = sum_k topk_scores[t, k] * F_{ids[t, k]}(x[t])`` with expert e on rank e // E_l; ``expert_fn`` is
    a standalone copy of F whose only inputs are the receive rows, the counts received from the exchange,
    split SymInts and expert weights (bound by ``ExpertFnBinding``); ``nodes`` is exactly what dies once
    ``output``'s uses go to a ring (the counts exchange and its host syncs included, ``x``/``topk_ids``/
    ``topk_scores``/``weights`` excluded), and regions share no such node.
    Refuses (legal but unsupported): an all-to-all whose partner is not in this graph (graph break), scores
    applied before the experts, F reading anything else (tokens, router, another collective), region values
    used outside the region, outputs whose shape or dtype differs from ``x``, non-contiguous expert placement.

Pseudo-code:
    # Step 1: classify collectives: token all-to-alls (floating point), integer counts exchanges.
    # Step 2: pair each token all-to-all (combine) with the closest token all-to-all upstream of its
    #         input (dispatch) whose splits it swaps; the rest are refused.
    # Step 3: dispatch side: send = x[order // K] with order = argsort(topk_ids.flatten()).
    # Step 4: combine side: y = scatter_add(zeros[T, H], order // K, back * topk_scores.flatten()[order]).
    # Step 5: split SymInts of the receive (per source, or per (source, expert)) and the counts exchange
    #         they come from; E_l.
    # Step 6: F = backward slice from the combine input down to the receive, the counts, the split SymInts
    #         and the expert weights, plus the mutators and asserts that act on it; copy it into a graph.
    # Step 7: the nodes that die once the output is replaced; refuse if the a2as would survive.

Legend: T local tokens, K top-k, H hidden, N ranks in the EP group, E_l experts per rank, S segment rows.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx as fx

log = logging.getLogger(__name__)

__all__ = ["ExpertFnBinding", "MoERegion", "RefusedRegion", "find_moe_regions"]


# ----------------------------------------------------------------------------------------------------------
# Op identities
# ----------------------------------------------------------------------------------------------------------

_C10D_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d_functional", "c10d")


def _both(ns: str, name: str) -> tuple[Any, ...]:
    """The ``OpOverloadPacket`` and its ``.default`` (Dynamo emits the packet, make_fx the overload)."""
    namespace = getattr(torch.ops, ns, None)
    packet = getattr(namespace, name, None) if namespace is not None else None
    if packet is None:
        return ()
    return (packet, packet.default)


# torch 2.11's all_to_all_single_autograd traces to the _c10d_functional_autograd variant (no top-level wait).
_A2A = (*_both("_c10d_functional", "all_to_all_single"), *_both("_c10d_functional_autograd", "all_to_all_single"))
_WAIT = _both("_c10d_functional", "wait_tensor")
_ALL_GATHER = _both("_c10d_functional", "all_gather_into_tensor")
_ASSERTS = (
    *_both("aten", "_assert_scalar"), *_both("aten", "_assert_async"), *_both("aten", "sym_constrain_range_for_size"),
    torch._check, torch._check_is_size,
)
_TORCHTITAN_SCATTER = "torchtitan::deterministic_scatter_add"

# Ops a value passes through unchanged in content, for the purposes of matching a role.
_CAST_METHODS = ("to", "type", "type_as", "float", "double", "half", "bfloat16", "contiguous", "clone")
_VIEW_METHODS = ("view", "reshape", "flatten", "unsqueeze", "expand", "expand_as", "squeeze")
_VIEW_FUNCTIONS = (torch.reshape, torch.flatten, torch.unsqueeze, torch.squeeze)


def _op_namespace(target: object) -> str | None:
    name = _qualname(target)
    return name.split("::")[0] if name else None


def _qualname(target: object) -> str | None:
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def _val(n: object) -> Any:
    """The fake value of a node (``val`` after make_fx, ``example_value`` from Dynamo), else the constant."""
    if isinstance(n, fx.Node):
        return n.meta.get("val", n.meta.get("example_value"))
    return n


def _is_fn(n: object, *targets: object) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and any(n.target is t for t in targets)


def _is_method(n: object, *names: str) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_method" and n.target in names


def _arg(n: fx.Node, index: int, name: str, default: object = None) -> object:
    if len(n.args) > index:
        return n.args[index]
    return n.kwargs.get(name, default)


def _is_a2a(n: object) -> bool:
    return _is_fn(n, *_A2A)


def _is_collective(n: fx.Node) -> bool:
    return n.op == "call_function" and _op_namespace(n.target) in _C10D_NAMESPACES


def _is_item(n: object) -> bool:
    """A host sync producing a SymInt: ``t.item()`` (Dynamo) or ``aten._local_scalar_dense`` (make_fx)."""
    return _is_method(n, "item") or _is_fn(n, *_both("aten", "_local_scalar_dense"))


def _is_assert(n: fx.Node) -> bool:
    return n.op == "call_function" and any(n.target is t for t in _ASSERTS)


def _is_mutator(n: fx.Node) -> bool:
    """An in-place write into its first argument: ``setitem``, ``t.foo_()``, or a mutating OpOverload."""
    if n.op == "call_function" and n.target is operator.setitem:
        return True
    if n.op == "call_method" and isinstance(n.target, str):
        return n.target.endswith("_") and not n.target.startswith("_")
    if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
        args = n.target._schema.arguments
        return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write
    return False


def _a2a_parts(n: fx.Node) -> tuple[fx.Node, list[object], list[object], object]:
    """``(input, output_split_sizes, input_split_sizes, group_name)`` of an all_to_all_single node."""
    return (
        _arg(n, 0, "input"),  # type: ignore[return-value]
        list(_arg(n, 1, "output_split_sizes") or []),  # type: ignore[arg-type]
        list(_arg(n, 2, "input_split_sizes") or []),  # type: ignore[arg-type]
        _arg(n, 3, "group_name"),
    )


def _wait_end(n: fx.Node) -> fx.Node:
    """Follow the wait chain of a collective to the node whose value the program reads.

    ``wait_tensor`` users (torchtitan waits twice on its counts), or torch 2.11's
    ``autograd_function_apply(..., a2a, ...)`` followed by ``getitem(., 0)``.
    """
    while True:
        waits = [u for u in n.users if _is_fn(u, *_WAIT)]
        if len(waits) == 1:
            n = waits[0]
            continue
        applies = [
            u for u in n.users
            if u.op == "call_function" and getattr(u.target, "__name__", "") == "autograd_function_apply"
        ]
        if len(applies) == 1:
            firsts = [g for g in applies[0].users if _is_fn(g, operator.getitem) and g.args[1] == 0]
            if len(firsts) == 1:
                n = firsts[0]
                continue
        return n


def _ancestors(roots: Iterable[object]) -> set[fx.Node]:
    """Every node some root reads, transitively (roots included)."""
    out: set[fx.Node] = set()
    stack = _flat_nodes(roots)
    while stack:
        m = stack.pop()
        if m in out:
            continue
        out.add(m)
        stack.extend(m.all_input_nodes)
    return out


def _upstream_collectives(roots: Iterable[object]) -> set[fx.Node]:
    """The collectives (all-to-all, all-gather; not waits) met first walking up from ``roots``."""
    found: set[fx.Node] = set()
    seen: set[fx.Node] = set()
    stack = _flat_nodes(roots)
    while stack:
        m = stack.pop()
        if m in seen:
            continue
        seen.add(m)
        if _is_a2a(m) or _is_fn(m, *_ALL_GATHER):
            found.add(m)
            continue
        stack.extend(m.all_input_nodes)
    return found


def _closest(candidates: set[fx.Node]) -> set[fx.Node]:
    """The candidates that are not upstream of another candidate."""
    if len(candidates) < 2:
        return candidates
    return {c for c in candidates if not any(c in _ancestors(o.all_input_nodes) for o in candidates - {c})}


def _flat_nodes(values: Iterable[object]) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(tuple(values), out.append)  # type: ignore[arg-type]
    return out


def _shape(n: object) -> tuple[Any, ...] | None:
    v = _val(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _dtype(n: object) -> torch.dtype | None:
    v = _val(n)
    return v.dtype if isinstance(v, torch.Tensor) else None


def _describe(n: fx.Node) -> str:
    target = n.target if isinstance(n.target, str) else _qualname(n.target) or getattr(n.target, "__name__", n.target)
    return f"{n.name} ({n.op} {target})"


# ----------------------------------------------------------------------------------------------------------
# Role patterns (each names the user code it matches)
# ----------------------------------------------------------------------------------------------------------


def _peel(n: object, methods: Sequence[str], functions: Sequence[Callable[..., Any]] = ()) -> object:
    """Strip casts/views named in ``methods``/``functions`` (first argument is the value)."""
    while isinstance(n, fx.Node) and (_is_method(n, *methods) or _is_fn(n, *functions)):
        n = n.args[0]
    return n


def _is_flatten(n: fx.Node) -> bool:
    """``t.flatten()``, ``t.view(-1)``, ``t.reshape(-1)``, ``torch.flatten(t)``, ``torch.reshape(t, (-1,))``."""
    if _is_method(n, "flatten") or _is_fn(n, torch.flatten):
        return len(n.args) == 1 and not n.kwargs
    if _is_method(n, "view", "reshape") or _is_fn(n, torch.reshape):
        shape = n.args[1:] if n.op == "call_method" else n.args[1:2]
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return tuple(shape) == (-1,)
    return False


def _unflatten(n: object) -> fx.Node | None:
    """The ``[T, K]`` tensor behind ``ids.flatten()`` (cast after flattening or not), else None."""
    n = _peel(n, _CAST_METHODS)
    if isinstance(n, fx.Node) and _is_flatten(n) and isinstance(n.args[0], fx.Node):
        return n.args[0]
    return None


def _sort_order(n: object) -> fx.Node | None:
    """The flat ids sorted by ``order = argsort(flat)`` / ``order = sort(flat)[1]``; None if ``n`` is neither."""
    if _is_fn(n, torch.argsort) or _is_method(n, "argsort"):
        return n.args[0]  # type: ignore[union-attr,return-value]
    if _is_fn(n, operator.getitem) and n.args[1] == 1:  # type: ignore[union-attr]
        s = n.args[0]  # type: ignore[union-attr]
        if _is_fn(s, torch.sort) or _is_method(s, "sort"):
            return s.args[0]  # type: ignore[union-attr,return-value]
    return None


def _token_index(n: object) -> tuple[fx.Node, int] | None:
    """``(order, K)`` of ``order // K`` (``operator.floordiv``, ``torch.div(..., rounding_mode="floor")``)."""
    n = _peel(n, (*_CAST_METHODS, *_VIEW_METHODS), _VIEW_FUNCTIONS)
    if not isinstance(n, fx.Node):
        return None
    floor_div = _is_fn(n, operator.floordiv, torch.floor_divide) or _is_method(n, "floor_divide", "__floordiv__")
    div_floor = (_is_fn(n, torch.div) or _is_method(n, "div")) and n.kwargs.get("rounding_mode") == "floor"
    if not (floor_div or div_floor):
        return None
    order, k = n.args[0], n.args[1]
    if isinstance(order, fx.Node) and isinstance(k, int) and not isinstance(k, bool):
        return order, k
    return None


def _row_gather(send: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(x, idx)`` of ``x[idx]`` / ``x[idx, :]`` / ``x.index_select(0, idx)`` / ``torch.index_select(x, 0, idx)``."""
    if _is_fn(send, operator.getitem):
        x, idx = send.args
        if isinstance(idx, tuple) and idx and all(i == slice(None) for i in idx[1:]):
            idx = idx[0]
        if isinstance(x, fx.Node) and isinstance(idx, fx.Node):
            return x, idx
    if _is_method(send, "index_select") or _is_fn(send, torch.index_select):
        x, dim, idx = send.args[0], _arg(send, 1, "dim"), _arg(send, 2, "index")
        if dim == 0 and isinstance(x, fx.Node) and isinstance(idx, fx.Node):
            return x, idx
    return None


def _score_column(n: object, order: fx.Node) -> fx.Node | None:
    """The ``[T, K]`` scores of ``scores.flatten()[order]`` (then cast / unsqueezed to a column), else None."""
    n = _peel(n, (*_CAST_METHODS, *_VIEW_METHODS), _VIEW_FUNCTIONS)
    if _is_fn(n, operator.getitem) and isinstance(n.args[1], tuple) and all(  # type: ignore[union-attr]
        i in (slice(None), None) for i in n.args[1]  # type: ignore[union-attr]
    ):  # scores_P[:, None]
        n = _peel(n.args[0], (*_CAST_METHODS, *_VIEW_METHODS), _VIEW_FUNCTIONS)  # type: ignore[union-attr]
    if _is_fn(n, operator.getitem) and n.args[1] is order:  # type: ignore[union-attr]
        return _unflatten(n.args[0])  # type: ignore[union-attr]
    return None


def _is_zeros(n: object) -> bool:
    """``torch.zeros_like(t)``, ``t.new_zeros(...)``, ``torch.zeros(...)`` (the scatter's fresh target)."""
    if _is_fn(n, torch.zeros_like, torch.zeros) or _is_method(n, "new_zeros", "zero_"):
        return True
    return _is_fn(n, torch.full_like) and n.args[1] == 0  # type: ignore[union-attr]


@dataclass(frozen=True, kw_only=True)
class _Scatter:
    node: fx.Node
    target: object
    index: object
    src: object
    in_place: bool


def _as_scatter(n: fx.Node) -> _Scatter | None:
    """``zeros.index_add(0, idx, v)`` / ``index_add_`` / ``torch.index_add`` / ``scatter_add(_)`` along dim 0 /
    ``torchtitan.deterministic_scatter_add(zeros, idx.expand(-1, H), v)``."""
    if _is_method(n, "index_add", "index_add_", "scatter_add", "scatter_add_") or _is_fn(
        n, torch.index_add, torch.scatter_add
    ):
        if n.kwargs.get("alpha", 1) != 1 or _arg(n, 1, "dim") != 0:
            return None
        src_name = "source" if "index_add" in getattr(n.target, "__name__", str(n.target)) else "src"
        return _Scatter(
            node=n, target=n.args[0], index=_arg(n, 2, "index"), src=_arg(n, 3, src_name),
            in_place=n.op == "call_method" and str(n.target).endswith("_"),
        )
    if n.op == "call_function" and _qualname(n.target) == _TORCHTITAN_SCATTER:
        return _Scatter(node=n, target=_arg(n, 0, "out"), index=_arg(n, 1, "index"), src=_arg(n, 2, "src"),
                        in_place=False)
    return None


def _forward_through(n: fx.Node, methods: Sequence[str]) -> list[fx.Node]:
    """``n`` and every node reached from it through single-input casts named in ``methods``."""
    out, stack = [], [n]
    while stack:
        m = stack.pop()
        out.append(m)
        stack.extend(u for u in m.users if _is_method(u, *methods) and u.args[0] is m)
    return out


# ----------------------------------------------------------------------------------------------------------
# Records
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ExpertFnBinding:
    """How the ring's ``F(x_SH, counts_NL, splits_N, weights)`` maps onto ``expert_fn``'s placeholders.

    Every field holds placeholder positions of ``expert_fn`` (None: F does not read that input).

    - ``rows``: the receive ``(R, H)``; gets the segment ``x_SH``.
    - ``counts``: the counts exchange's received tensor; gets ``counts_NL.reshape(counts_shape)``.
    - ``splits``: ``splits[s][e]`` is the SymInt of source ``s`` (``split_kind="source"``: one per source,
      gets ``splits_N[s]``) or of (source ``s``, local expert ``e``) (``"source_expert"``: gets
      ``counts_NL[s, e]`` read on the host).
    - ``weights``: one per ``MoERegion.weights`` entry, in that order; gets the visiting partition.
    """

    rows: int
    counts: int | None
    counts_shape: tuple[int, ...] | None
    split_kind: Literal["source", "source_expert"]
    splits: tuple[tuple[int | None, ...], ...]
    weights: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class MoERegion:
    """One a2a EP MoE block of a graph, understood well enough to run as a ring.

    Nodes are those of the matched graph; ``expert_fn`` is a standalone copy (its own graph).
    """

    dispatch: fx.Node  # token all_to_all_single (send -> recv)
    combine: fx.Node  # reverse all_to_all_single (F's output -> back)
    recv: fx.Node  # end of the dispatch's wait chain: F's row input
    back: fx.Node  # end of the combine's wait chain
    counts_exchange: fx.Node  # the integer collective the split sizes come from (a2a or all_gather)
    x: fx.Node  # resident tokens (T, H)
    topk_ids: fx.Node  # (T, K) global expert ids
    topk_scores: fx.Node  # (T, K), applied after the combine
    order: fx.Node  # argsort of the flat ids
    output: fx.Node  # y (T, H): what the ring replaces
    weights: tuple[fx.Node, ...]  # the local expert weights F reads (DTensor parameters: after to_local)
    expert_fn: fx.GraphModule  # F: recv rows, counts, split SymInts, weights -> out (R, H)
    binding: ExpertFnBinding
    experts_per_rank: int
    top_k: int
    group_name: str
    group_size: int
    nodes: frozenset[fx.Node]  # what dies once output's uses go elsewhere

    def describe(self) -> str:
        return (
            f"MoE region dispatch={self.dispatch.name} combine={self.combine.name} output={self.output.name} "
            f"(group {self.group_name!r} of {self.group_size}, E_l={self.experts_per_rank}, K={self.top_k}, "
            f"{len(self.weights)} weights, F: {len(self.expert_fn.graph.nodes)} nodes)"
        )


@dataclass(frozen=True)
class RefusedRegion:
    """A token all-to-all left unchanged, and why."""

    node: fx.Node
    reason: str


class _Refuse(Exception):
    def __init__(self, node: fx.Node, reason: str) -> None:
        super().__init__(reason)
        self.node, self.reason = node, reason


# ----------------------------------------------------------------------------------------------------------
# Step 2: pairing
# ----------------------------------------------------------------------------------------------------------


def _same_splits(a: Sequence[object], b: Sequence[object]) -> bool:
    return len(a) == len(b) and all(x is y or (not isinstance(x, fx.Node) and x == y) for x, y in zip(a, b))


def _pair_token_a2as(token_a2as: list[fx.Node]) -> tuple[list[tuple[fx.Node, fx.Node]], list[RefusedRegion]]:
    """Pair each combine with its dispatch on dataflow: the closest token a2a upstream, with swapped splits."""
    paired: set[fx.Node] = set()
    pairs: list[tuple[fx.Node, fx.Node]] = []
    token_set = set(token_a2as)
    for combine in token_a2as:
        upstream = _closest(_upstream_collectives([_a2a_parts(combine)[0]]) & token_set)
        if len(upstream) != 1:
            continue
        dispatch = upstream.pop()
        if dispatch in paired:
            continue
        _, d_out, d_in, _ = _a2a_parts(dispatch)
        _, c_out, c_in, _ = _a2a_parts(combine)
        if not (_same_splits(c_out, d_in) and _same_splits(c_in, d_out)):
            continue
        paired |= {dispatch, combine}
        pairs.append((dispatch, combine))
    refused = [
        RefusedRegion(
            n,
            f"all_to_all {n.name} has no partner in this graph (no all_to_all with swapped splits reads its "
            "result, nor is it the answer to one): the region is probably split by a graph break (at .tolist() "
            "of the split sizes: compile with torch._dynamo.config.capture_scalar_outputs=True)",
        )
        for n in token_a2as if n not in paired
    ]
    return pairs, refused


# ----------------------------------------------------------------------------------------------------------
# Steps 3-7: one region
# ----------------------------------------------------------------------------------------------------------


def _match_dispatch_side(dispatch: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, int]:
    """Step 3: ``(x, topk_ids, order, K)`` from ``send = x[order // K]``."""
    send = _a2a_parts(dispatch)[0]
    gather = _row_gather(send) if isinstance(send, fx.Node) else None
    if gather is None:
        if _is_fn(send, operator.mul, torch.mul) or _is_method(send, "mul"):
            raise _Refuse(dispatch, f"scores applied before the experts: the dispatch sends {send.name}, a "
                                    "product, not a row gather x[order // K]; the ring applies scores after F")
        what = send.name if isinstance(send, fx.Node) else repr(send)
        raise _Refuse(dispatch, f"the dispatch input {what} is not a row gather x[order // K] of the tokens")
    x, idx = gather
    token = _token_index(idx)
    if token is None:
        raise _Refuse(dispatch, f"the send gather {send.name} indexes by {idx.name}, not order // K")
    order, top_k = token
    flat_ids = _sort_order(order)
    topk_ids = _unflatten(flat_ids) if flat_ids is not None else None
    if topk_ids is None:
        raise _Refuse(dispatch, f"{order.name} is not argsort / sort of the flattened top-k expert ids")
    ids_shape, x_shape = _shape(topk_ids), _shape(x)
    if ids_shape is None or len(ids_shape) != 2 or ids_shape[1] != top_k:
        raise _Refuse(dispatch, f"top-k ids {topk_ids.name} have shape {ids_shape}, not (T, K={top_k})")
    if x_shape is None or len(x_shape) != 2 or x_shape[0] != ids_shape[0]:
        raise _Refuse(dispatch, f"tokens {x.name} have shape {x_shape}, not (T={ids_shape[0]}, H)")
    ids_dtype, x_dtype = _dtype(topk_ids), _dtype(x)
    if ids_dtype is None or ids_dtype.is_floating_point or ids_dtype == torch.bool:
        raise _Refuse(dispatch, f"top-k ids {topk_ids.name} have dtype {ids_dtype}, not an integer type")
    if x_dtype is None or not x_dtype.is_floating_point:
        raise _Refuse(dispatch, f"tokens {x.name} have dtype {x_dtype}, not floating point")
    return x, topk_ids, order, top_k


def _match_combine_side(combine: fx.Node, back: fx.Node, order: fx.Node, top_k: int) -> tuple[fx.Node, fx.Node]:
    """Step 4: ``(output, topk_scores)`` from ``scatter_add(zeros, order // K, back * scores.flatten()[order])``."""
    for weighted in _forward_through(back, _CAST_METHODS):
        for mul in weighted.users:
            if not (_is_fn(mul, operator.mul, torch.mul) or _is_method(mul, "mul")):
                continue
            other = mul.args[1] if mul.args[0] is weighted else mul.args[0]
            scores = _score_column(other, order)
            if scores is None:
                continue
            for src in _forward_through(mul, _CAST_METHODS):
                for user in src.users:
                    scatter = _as_scatter(user)
                    if scatter is None or scatter.src is not src:
                        continue
                    token = _token_index(scatter.index)
                    if token is None or token[0] is not order or token[1] != top_k:
                        raise _Refuse(combine, f"the combine scatter {user.name} does not index by order // K")
                    if not _is_zeros(scatter.target):
                        raise _Refuse(combine, f"the combine scatter {user.name} adds into "
                                               f"{getattr(scatter.target, 'name', scatter.target)}, not fresh zeros")
                    if scatter.in_place and len(scatter.target.users) != 1:  # type: ignore[union-attr]
                        raise _Refuse(combine, f"{user.name} scatters in place into a buffer read elsewhere; only "
                                               "the scatter's result can be replaced")
                    return user, scores
    raise _Refuse(combine, f"no scatter_add(zeros, order // K, {back.name} * topk_scores.flatten()[order]) "
                           "after the combine (scores applied elsewhere, or another reduction)")


def _split_leaves(n: object) -> list[fx.Node] | None:
    """The ``.item()`` SymInts a split size adds up (``torch.sym_sum``, ``+``), else None."""
    if _is_item(n):
        return [n]  # type: ignore[list-item]
    if _is_fn(n, torch.sym_sum):
        out: list[fx.Node] = []
        for a in n.args[0]:  # type: ignore[union-attr]
            leaves = _split_leaves(a)
            if leaves is None:
                return None
            out += leaves
        return out
    if _is_fn(n, operator.add):
        a, b = _split_leaves(n.args[0]), _split_leaves(n.args[1])  # type: ignore[union-attr]
        return None if a is None or b is None else a + b
    return None


def _flat_index_of_item(item: fx.Node) -> tuple[fx.Node, int] | None:
    """``(t, k)`` for ``t[k].item()`` on a 1-D tensor t, else None."""
    g = item.args[0] if item.op == "call_method" else None
    if not (isinstance(g, fx.Node) and _is_fn(g, operator.getitem)):
        return None
    t, k = g.args
    if isinstance(t, fx.Node) and isinstance(k, int) and len(_shape(t) or ()) == 1:
        return t, k
    return None


def _match_splits(
    dispatch: fx.Node, group_size: int
) -> tuple[Literal["source", "source_expert"], list[list[fx.Node]], fx.Node, int]:
    """Step 5: ``(kind, leaves[s][e], counts exchange, E_l)`` of the dispatch's receive splits."""
    _, out_splits, in_splits, _ = _a2a_parts(dispatch)
    if len(out_splits) != group_size or len(in_splits) != group_size:
        raise _Refuse(dispatch, f"split lists of {dispatch.name} have lengths {len(out_splits)}, {len(in_splits)}")
    leaves = []
    for s, split in enumerate(out_splits):
        found = _split_leaves(split)
        if not found:
            raise _Refuse(dispatch, f"receive split {s} of {dispatch.name} ({split!r}) is not a host read (.item()) "
                                    "of the exchanged counts in this graph (compile with torch._dynamo.config."
                                    "capture_scalar_outputs=True so .tolist() of the splits stays in the graph)")
        leaves.append(found)
    widths = {len(x) for x in leaves}
    if len(widths) != 1:
        raise _Refuse(dispatch, f"receive splits of {dispatch.name} add up different numbers of SymInts {widths}")
    width = widths.pop()
    # The counts exchange: the integer collective the split SymInts come from.
    exchanges = _closest({
        n for n in _upstream_collectives(leaf for row in leaves for leaf in row)
        if not (_dtype(n) or torch.float32).is_floating_point
    })
    if len(exchanges) != 1:
        raise _Refuse(dispatch, f"receive splits of {dispatch.name} come from {len(exchanges)} integer collectives, "
                                "not one counts exchange")
    exchange = exchanges.pop()
    numel = 1
    for d in _shape(exchange) or ():
        numel *= d
    if _is_a2a(exchange):  # received counts (N, E_l), row s from source s
        e_l, rem = divmod(numel, group_size)
        for splits in _a2a_parts(exchange)[1:3]:
            # Equal static splits: rank r owns experts [r * E_l, (r + 1) * E_l), as the ring assumes.
            if splits and (len(set(map(repr, splits))) != 1 or not isinstance(splits[0], int)):
                raise _Refuse(dispatch, f"counts exchange {exchange.name} has splits {splits}, not equal constants: "
                                        "experts are not placed contiguously (expert e on rank e // E_l)")
    else:  # all_gather of every rank's counts per global expert: (N, E)
        e_l, rem = divmod(numel, group_size * group_size)
    if rem or e_l < 1:
        raise _Refuse(dispatch, f"counts exchange {exchange.name} holds {numel} counts, not E_l per rank pair")
    kind: Literal["source", "source_expert"]
    if width == 1:
        kind = "source"
    elif width == e_l:
        kind = "source_expert"
        # The (s, e) SymInt is element s * E_l + e of a flattened (N, E_l) tensor when it reads one.
        for s, row in enumerate(leaves):
            flats = [_flat_index_of_item(leaf) for leaf in row]
            if all(f is not None and _shape(f[0]) == (group_size * e_l,) for f in flats):
                # A sum lists its terms in any order (Dynamo folds `sum(...)` into torch.sym_sum): bind each
                # SymInt by the element it reads, then check the row holds exactly source s's elements.
                row.sort(key=lambda leaf: _flat_index_of_item(leaf)[1])  # type: ignore[index]
            for e, leaf in enumerate(row):
                flat = _flat_index_of_item(leaf)
                shape = _shape(flat[0]) if flat is not None else None
                if flat is not None and shape == (group_size * e_l,) and flat[1] != s * e_l + e:
                    raise _Refuse(dispatch, f"receive split SymInt {leaf.name} reads counts element {flat[1]}, "
                                            f"not (source {s}, expert {e})")
    else:
        raise _Refuse(dispatch, f"receive splits of {dispatch.name} add up {width} SymInts each; expected 1 (per "
                                f"source) or E_l={e_l} (per source and expert)")
    return kind, leaves, exchange, e_l


def _router_num_experts(topk_ids: fx.Node) -> int | None:
    """E from ``topk(scores_TE, K)[1]`` behind the ids (through views), when the ids come from a topk."""
    n = _peel(topk_ids, _VIEW_METHODS, _VIEW_FUNCTIONS)
    if _is_fn(n, operator.getitem) and n.args[1] == 1:  # type: ignore[union-attr]
        topk = n.args[0]  # type: ignore[union-attr]
        if _is_fn(topk, torch.topk) or _is_method(topk, "topk"):
            shape = _shape(topk.args[0])  # type: ignore[union-attr]
            if shape and isinstance(shape[-1], int):
                return shape[-1]
    return None


def _is_weight_source(n: fx.Node) -> bool:
    """A tensor F may take from outside as expert weight: a placeholder / get_attr, or ``p.to_local()`` of one."""
    if n.op in ("placeholder", "get_attr"):
        return isinstance(_val(n), torch.Tensor) or n.op == "get_attr"
    return _is_method(n, "to_local") and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder"


def _is_symbolic_arith(n: fx.Node) -> bool:
    """Pure SymInt/SymBool arithmetic (``sym_sum``, ``+``, ``>=``, ``==``...): what Dynamo's asserts compare."""
    if n.op != "call_function" or _is_collective(n) or _is_item(n) or _is_assert(n) or _is_mutator(n):
        return False
    return isinstance(_val(n), (torch.SymInt, torch.SymBool, int, bool))


def _slice_expert_fn(
    dispatch: fx.Node, combine: fx.Node, inputs: dict[fx.Node, str], forbidden: set[fx.Node]
) -> tuple[list[fx.Node], set[fx.Node], list[fx.Node]]:
    """Step 6: ``(F's nodes in program order, inputs F reads, weights)``.

    F is the backward slice of the combine input that stops at ``inputs`` (receive, counts, split SymInts)
    and at weight sources, plus in-place writes into its values that have no users (torchtitan's ``setitem``
    unpermute), plus the asserts on its SymInts whose comparisons read only F and its inputs.
    """
    body: set[fx.Node] = set()
    used: set[fx.Node] = set()
    weights: set[fx.Node] = set()
    stack = _flat_nodes([_a2a_parts(combine)[0]])
    while stack:
        n = stack.pop()
        if n in body or n in used or n in weights:
            continue
        if n in inputs:
            used.add(n)
            continue
        if _is_weight_source(n):
            if n in forbidden or (n.op == "call_method" and n.args[0] in forbidden):
                raise _Refuse(dispatch, f"F reads {_describe(n)}, which also feeds the dispatch (tokens or "
                                        "routing); only expert weights may enter F from outside")
            weights.add(n)
            continue
        if n.op == "placeholder":
            raise _Refuse(dispatch, f"F reads {_describe(n)}, which is neither a tensor nor a split size of the "
                                    "receive")
        if _is_collective(n):
            raise _Refuse(dispatch, f"F reads {_describe(n)}, a collective that is neither the token receive "
                                    "nor the counts exchange")
        body.add(n)
        stack.extend(n.all_input_nodes)
        for u in n.users:
            if not u.users and _is_mutator(u) and u.args[0] is n:
                stack.append(u)
    # Writes into F's values from outside F would change what F computes.
    for n in body:
        for u in n.users:
            if u not in body and _is_mutator(u) and u.args[0] is n:
                raise _Refuse(dispatch, f"{_describe(u)} writes into F's {n.name} from outside the region")
    # Asserts on F's SymInts (Dynamo's checks of .item() values) whose comparisons read only F and its inputs.
    known = body | used
    asserts: set[fx.Node] = set()
    seen: set[fx.Node] = set()
    todo = list(body)
    while todo:
        for u in todo.pop().users:
            if u in known or u in seen:
                continue
            seen.add(u)
            if _is_assert(u) and not u.users:
                asserts.add(u)
            elif _is_symbolic_arith(u):
                todo.append(u)
    for a in asserts:
        cone: set[fx.Node] = set()
        ok, todo = True, list(a.all_input_nodes)
        while todo and ok:
            m = todo.pop()
            if m not in known and m not in cone:
                ok = _is_symbolic_arith(m)
                cone.add(m)
                todo.extend(m.all_input_nodes)
        if ok:
            body |= cone | {a}
    order = {n: i for i, n in enumerate(combine.graph.nodes)}
    return sorted(body, key=order.__getitem__), used, sorted(weights, key=order.__getitem__)


def _copy_expert_fn(
    gm: fx.GraphModule,
    body: list[fx.Node],
    output: object,
    rows: fx.Node,
    counts: fx.Node | None,
    split_leaves: list[list[fx.Node]],
    weights: list[fx.Node],
    used: set[fx.Node],
    kind: Literal["source", "source_expert"],
) -> tuple[fx.GraphModule, ExpertFnBinding]:
    """Step 6 (cont.): copy F into a fresh graph; placeholders: rows, counts, used splits, weights."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    position = 0

    def placeholder(src: fx.Node, name: str) -> int:
        nonlocal position
        ph = graph.placeholder(name)
        ph.meta = dict(src.meta)
        env[src] = ph
        position += 1
        return position - 1

    rows_pos = placeholder(rows, "rows")
    counts_pos = placeholder(counts, "counts") if counts is not None and counts in used else None
    splits: list[tuple[int | None, ...]] = []
    for s, row in enumerate(split_leaves):
        entry: list[int | None] = []
        for e, leaf in enumerate(row):
            used_here = leaf in used and leaf not in env
            entry.append(placeholder(leaf, f"split_s{s}" if kind == "source" else f"split_s{s}_e{e}")
                         if used_here else None)
        splits.append(tuple(entry))
    weight_pos = tuple(placeholder(w, w.name) for w in weights)
    for n in body:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(fx.node.map_arg(output, lambda a: env[a]))  # type: ignore[arg-type]
    graph.lint()
    fn = fx.GraphModule(gm, graph, class_name="ExpertFn")
    counts_shape = _shape(counts) if counts_pos is not None else None
    binding = ExpertFnBinding(
        rows=rows_pos,
        counts=counts_pos,
        counts_shape=tuple(int(d) for d in counts_shape) if counts_shape is not None else None,
        split_kind=kind,
        splits=tuple(splits),
        weights=weight_pos,
    )
    return fn, binding


def _assert_cones(graph: fx.Graph) -> set[fx.Node]:
    """Asserts with no users, and the pure SymInt arithmetic only they read (Dynamo's runtime checks)."""
    weak: set[fx.Node] = set()
    for n in reversed(graph.nodes):
        if _is_assert(n) and not n.users or n.users and all(u in weak for u in n.users) and _is_symbolic_arith(n):
            weak.add(n)
    return weak


def _dead_after_replacing(output: fx.Node, pinned: set[fx.Node], weak: set[fx.Node]) -> set[fx.Node]:
    """Step 7: the nodes that die once ``output`` has no users (``output`` included).

    A node dies when it has a dead user and every other user is dead, in an assert cone (``weak``), or an
    in-place write into it with no users. A node of an assert cone dies with any dead input or with all its
    users; an in-place write with no users dies with what it writes. Pinned nodes (the ring's inputs) and
    placeholders never die; other side effects (buffer updates, grad-mode toggles) are kept.
    """
    dead = {output}
    todo = list(output.all_input_nodes)
    while todo:
        n = todo.pop()
        if n in dead or n in pinned or n.op in ("placeholder", "output"):
            continue
        if n in weak:
            dies = any(a in dead for a in n.all_input_nodes) or bool(n.users) and all(u in dead for u in n.users)
        elif not n.users:
            dies = _is_mutator(n) and n.args[0] in dead
        else:
            dies = any(u in dead for u in n.users) and all(
                u in dead or u in weak or (not u.users and _is_mutator(u) and u.args[0] is n) for u in n.users
            )
        if dies:
            dead.add(n)
            todo.extend(n.all_input_nodes)
            todo.extend(u for u in n.users if u not in dead)
    return dead


def _match_region(gm: fx.GraphModule, dispatch: fx.Node, combine: fx.Node, weak: set[fx.Node]) -> MoERegion:
    _, d_out, _, group_name = _a2a_parts(dispatch)
    if not isinstance(group_name, str) or _a2a_parts(combine)[3] != group_name:
        raise _Refuse(dispatch, f"group names of {dispatch.name} and {combine.name} are not one constant string")
    group_size = len(d_out)
    recv, back = _wait_end(dispatch), _wait_end(combine)

    # Step 3: dispatch side.
    x, topk_ids, order, top_k = _match_dispatch_side(dispatch)

    # Step 4: combine side.
    output, topk_scores = _match_combine_side(combine, back, order, top_k)
    if _shape(topk_scores) != _shape(topk_ids) or not (_dtype(topk_scores) or torch.int64).is_floating_point:
        raise _Refuse(combine, f"top-k scores {topk_scores.name} are not floating point of the ids' shape")
    if _shape(output) != _shape(x) or _dtype(output) != _dtype(x):
        raise _Refuse(combine, f"the block output {output.name} is {_dtype(output)}{list(_shape(output) or [])}, "
                               f"the tokens {_dtype(x)}{list(_shape(x) or [])}; the ring returns the tokens' type")

    # Step 5: splits, counts exchange, E_l.
    kind, leaves, exchange, e_l = _match_splits(dispatch, group_size)
    exchange_group = _arg(exchange, 3, "group_name") if _is_a2a(exchange) else _arg(exchange, 2, "group_name")
    if exchange_group != group_name:
        raise _Refuse(dispatch, f"counts exchange {exchange.name} runs on group {exchange_group!r}, the tokens on "
                                f"{group_name!r}")
    counts = _wait_end(exchange) if _is_a2a(exchange) else None
    num_experts = _router_num_experts(topk_ids)
    if num_experts is not None and num_experts != e_l * group_size:
        raise _Refuse(dispatch, f"the router picks among {num_experts} experts but the counts exchange "
                                f"{exchange.name} implies {e_l} per rank on {group_size} ranks")

    # Step 6: F.
    inputs: dict[fx.Node, str] = {recv: "rows"}
    if counts is not None:
        inputs[counts] = "counts"
    for row in leaves:
        for leaf in row:
            inputs[leaf] = "split"
    forbidden = _ancestors([_a2a_parts(dispatch)[0], topk_ids, topk_scores])
    body, used, weights = _slice_expert_fn(dispatch, combine, inputs, forbidden)
    if recv not in used:
        raise _Refuse(dispatch, f"F does not read the token receive {recv.name}")
    expert_fn, binding = _copy_expert_fn(
        gm, body, _a2a_parts(combine)[0], recv, counts, leaves, weights, used, kind
    )

    # Step 7: what dies.
    dead = _dead_after_replacing(output, {x, topk_ids, topk_scores, *weights}, weak)
    for role, n in (("dispatch", dispatch), ("combine", combine), ("receive", recv), ("combine result", back)):
        if n not in dead:
            users = ", ".join(u.name for u in n.users)
            raise _Refuse(dispatch, f"the {role} {n.name} stays alive after the rewrite (a value of the region "
                                    f"is used outside it; users: {users})")
    for n in body:
        if n not in dead:
            raise _Refuse(dispatch, f"F's {n.name} is used outside the region")
    return MoERegion(
        dispatch=dispatch, combine=combine, recv=recv, back=back, counts_exchange=exchange, x=x,
        topk_ids=topk_ids, topk_scores=topk_scores, order=order, output=output, weights=tuple(weights),
        expert_fn=expert_fn, binding=binding, experts_per_rank=e_l, top_k=top_k, group_name=group_name,
        group_size=group_size, nodes=frozenset(dead),
    )


# ----------------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------------


def find_moe_regions(gm: fx.GraphModule) -> tuple[list[MoERegion], list[RefusedRegion]]:
    """All a2a EP MoE regions of ``gm`` in program order, and the token all-to-alls left alone (with why).

    Pure: never mutates ``gm`` (``expert_fn`` of each region is a copy).
    """
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    # Step 1: token all-to-alls by the dtype of what they move (the counts exchange moves integers).
    token_a2as = [n for n in gm.graph.nodes if _is_a2a(n) and (_dtype(n) or torch.int64).is_floating_point]
    # Step 2: pairs.
    pairs, refused = _pair_token_a2as(token_a2as)
    regions: list[MoERegion] = []
    weak = _assert_cones(gm.graph)
    for dispatch, combine in pairs:
        try:
            regions.append(_match_region(gm, dispatch, combine, weak))
        except _Refuse as r:
            refused.append(RefusedRegion(r.node, r.reason))
    # Regions are rewritten one after the other: they must not share a node that dies.
    regions.sort(key=lambda r: position[r.dispatch])
    claimed: set[fx.Node] = set()
    for region in list(regions):
        shared = claimed & region.nodes
        if shared:
            regions.remove(region)
            refused.append(RefusedRegion(region.dispatch, f"shares {sorted(n.name for n in shared)} with an "
                                                          "earlier region"))
        claimed |= region.nodes
    for r in refused:
        log.debug("match: skipped %s: %s", r.node.name, r.reason)
    for region in regions:
        log.debug("match: found %s", region.describe())
    refused.sort(key=lambda r: position[r.node])
    return regions, refused

"""roles: recognizers of the values an all-to-all MoE block computes, each naming the user code it matches.

Each recognizer takes a node (or an argument) and returns what the role binds (``(x, idx)`` of a row gather,
``(order, K)`` of ``order // K``, ...) or ``None``: recognizers never refuse and never mutate; ``match``
decides what a missing role means. They see through the casts and views user code puts in between
(``CAST_METHODS``, ``VIEW_METHODS``, ``VIEW_FUNCTIONS``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from relay_compile.passes.fx_nodes import (
    arg,
    as_list,
    dtype_of,
    is_assert,
    is_call,
    is_collective,
    is_fresh,
    is_item,
    is_method_call,
    is_mutator,
    node_value,
    qualname,
    same_size,
    shape_of,
    size_value,
)

# ``torchtitan.distributed.expert_parallel``'s combine: a scatter-add with a deterministic backward.
TORCHTITAN_SCATTER = "torchtitan::deterministic_scatter_add"

# Ops a value passes through unchanged in content, for the purposes of matching a role.
CAST_METHODS = ("to", "type", "type_as", "float", "double", "half", "bfloat16", "contiguous", "clone")
VIEW_METHODS = ("view", "reshape", "flatten", "unsqueeze", "expand", "expand_as", "squeeze")
VIEW_FUNCTIONS = (torch.reshape, torch.flatten, torch.unsqueeze, torch.squeeze)


def _node_or_none(v: object) -> fx.Node | None:
    return v if isinstance(v, fx.Node) else None


def peel(n: object, methods: Sequence[str], functions: Sequence[Callable[..., Any]] = ()) -> object:
    """Strip casts/views named in ``methods``/``functions`` (first argument is the value)."""
    while isinstance(n, fx.Node) and (is_method_call(n, *methods) or is_call(n, *functions)):
        n = n.args[0]
    return n


def is_flatten(n: fx.Node) -> bool:
    """``t.flatten()``, ``t.view(-1)``, ``t.reshape(-1)``, ``torch.flatten(t)``, ``torch.reshape(t, (-1,))``."""
    if is_method_call(n, "flatten") or is_call(n, torch.flatten):
        return len(n.args) == 1 and not n.kwargs
    if is_method_call(n, "view", "reshape") or is_call(n, torch.reshape):
        shape = n.args[1:] if n.op == "call_method" else n.args[1:2]
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return tuple(shape) == (-1,)
    return False


def unflatten(n: object) -> fx.Node | None:
    """The ``[T, K]`` tensor behind ``ids.flatten()`` (cast after flattening or not), else None."""
    n = peel(n, CAST_METHODS)
    if isinstance(n, fx.Node) and is_flatten(n) and isinstance(n.args[0], fx.Node):
        return n.args[0]
    return None


def sort_order(n: object) -> fx.Node | None:
    """The flat ids sorted by ``order = argsort(flat)`` / ``order = sort(flat)[1]``; None if ``n`` is neither."""
    if is_call(n, torch.argsort) or is_method_call(n, "argsort"):
        return _node_or_none(n.args[0])
    if is_call(n, operator.getitem) and n.args[1] == 1:
        s = n.args[0]
        if is_call(s, torch.sort) or is_method_call(s, "sort"):
            return _node_or_none(s.args[0])
    return None


def token_index(n: object) -> tuple[fx.Node, object] | None:
    """``(order, K)`` of ``order // K`` (``operator.floordiv``, ``torch.div(..., rounding_mode="floor")``).

    ``K`` is an int, or under dynamic shapes a node of a SymInt (``ids.size(1)``): compare it with ``same_size``.
    """
    n = peel(n, (*CAST_METHODS, *VIEW_METHODS), VIEW_FUNCTIONS)
    if not isinstance(n, fx.Node):
        return None
    floor_div = is_call(n, operator.floordiv, torch.floor_divide) or is_method_call(n, "floor_divide", "__floordiv__")
    div_floor = (is_call(n, torch.div) or is_method_call(n, "div")) and n.kwargs.get("rounding_mode") == "floor"
    if not (floor_div or div_floor):
        return None
    order, k = n.args[0], n.args[1]
    if isinstance(order, fx.Node) and size_value(k) is not None:
        return order, k
    return None


def row_gather(send: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(x, idx)`` of ``x[idx]`` / ``x[idx, :]`` / ``x.index_select(0, idx)`` / ``torch.index_select(x, 0, idx)``."""
    if is_call(send, operator.getitem):
        x, index = send.args
        # x[idx, :, ...]: the first index picks rows, the rest keep everything.
        if isinstance(index, tuple) and index and all(i == slice(None) for i in index[1:]):
            index = index[0]
        if isinstance(x, fx.Node) and isinstance(index, fx.Node):
            return x, index
    if is_method_call(send, "index_select") or is_call(send, torch.index_select):
        x, dim, idx = send.args[0], arg(send, 1, "dim"), arg(send, 2, "index")
        if dim == 0 and isinstance(x, fx.Node) and isinstance(idx, fx.Node):
            return x, idx
    return None


def score_column(n: object, order: fx.Node) -> fx.Node | None:
    """The ``[T, K]`` scores of ``scores.flatten()[order]`` (then cast / unsqueezed to a column), else None."""
    n = peel(n, (*CAST_METHODS, *VIEW_METHODS), VIEW_FUNCTIONS)
    if is_call(n, operator.getitem) and isinstance(n.args[1], tuple) and all(
        i in (slice(None), None) for i in n.args[1]
    ):  # scores_P[:, None]
        n = peel(n.args[0], (*CAST_METHODS, *VIEW_METHODS), VIEW_FUNCTIONS)
    if is_call(n, operator.getitem) and n.args[1] is order:
        return unflatten(n.args[0])
    return None


def is_zeros(n: object) -> bool:
    """``torch.zeros_like(t)``, ``t.new_zeros(...)``, ``torch.zeros(...)`` (the scatter's fresh target)."""
    if is_call(n, torch.zeros_like, torch.zeros) or is_method_call(n, "new_zeros", "zero_"):
        return True
    return is_call(n, torch.full_like) and isinstance(n.args[1], (int, float)) and n.args[1] == 0


@dataclass(frozen=True, kw_only=True)
class Scatter:
    """A scatter-add along dim 0: ``target[index[i]] += src[i]``."""

    node: fx.Node
    target: object
    index: object
    src: object
    in_place: bool


def as_scatter(n: fx.Node) -> Scatter | None:
    """``zeros.index_add(0, idx, v)`` / ``index_add_`` / ``torch.index_add`` / ``scatter_add(_)`` along dim 0 /
    ``torchtitan.deterministic_scatter_add(zeros, idx.expand(-1, H), v)``."""
    if is_method_call(n, "index_add", "index_add_", "scatter_add", "scatter_add_") or is_call(
        n, torch.index_add, torch.scatter_add
    ):
        if n.kwargs.get("alpha", 1) != 1 or arg(n, 1, "dim") != 0:
            return None
        src_name = "source" if "index_add" in getattr(n.target, "__name__", str(n.target)) else "src"
        return Scatter(
            node=n, target=n.args[0], index=arg(n, 2, "index"), src=arg(n, 3, src_name),
            in_place=n.op == "call_method" and str(n.target).endswith("_"),
        )
    if n.op == "call_function" and qualname(n.target) == TORCHTITAN_SCATTER:
        return Scatter(node=n, target=arg(n, 0, "out"), index=arg(n, 1, "index"), src=arg(n, 2, "src"),
                        in_place=False)
    return None


def unsqueezed_last(n: object) -> fx.Node | None:
    """``g`` of ``g.unsqueeze(-1)`` / ``g.unsqueeze(2)`` / ``g[..., None]`` / ``g[:, :, None]`` (g 2-D), else None."""
    if is_method_call(n, "unsqueeze") or is_call(n, torch.unsqueeze):
        g = n.args[0]
        if len(shape_of(g) or ()) == 2 and arg(n, 1, "dim") in (-1, 2):
            return g
    if is_call(n, operator.getitem) and isinstance(n.args[1], tuple):
        g, index = n.args
        if len(shape_of(g) or ()) == 2 and index in ((Ellipsis, None), (slice(None), slice(None), None)):
            return g
    return None


def weighted_route_sum(routed: fx.Node) -> tuple[fx.Node, fx.Node, int] | None:
    """``(gates, sum, dim)`` of ``(routed * gates.unsqueeze(-1)).sum(dim)``, routed ``(A, B, H)`` (each token's
    routes along A or B), else None."""
    for mul in routed.users:
        if not (is_call(mul, operator.mul, torch.mul) or is_method_call(mul, "mul")) or len(mul.args) != 2:
            continue
        other = mul.args[1] if mul.args[0] is routed else mul.args[0]
        gates = unsqueezed_last(peel(other, CAST_METHODS))
        if gates is None or not (dtype_of(gates) or torch.int64).is_floating_point:
            continue
        for total in mul.users:
            if is_method_call(total, "sum") or is_call(total, torch.sum):
                dim = arg(total, 1, "dim")
                if dim in (0, 1) and not total.kwargs.get("keepdim", False):
                    return gates, total, int(dim)
    return None


def unpermuted_sum(back: fx.Node, order: fx.Node, top_k: object) -> tuple[fx.Node, fx.Node] | None:
    """``(y, topk_scores)`` of a combine that unpermutes into a fresh buffer, then sums each token's routes
    (transformers' ``AllToAllEP._combine_tokens``)::

        buf = torch.empty_like(back); buf[order] = back              # buf[t * K + k]: the output of pair (t, k)
        y = (buf.view(T, K, H) * topk_scores.unsqueeze(-1)).sum(dim=1)

    or, the same rows, ``buf = back[argsort(order)]`` (the inverse permutation). ``order`` is the dispatch's
    argsort, a permutation: every row of ``buf`` is written. None if not this form.
    """
    for value in forward_through(back, CAST_METHODS):
        for user in value.users:
            if is_call(user, operator.setitem) and user.args[2] is value and is_fresh(user.args[0]):
                if peel(user.args[1], CAST_METHODS) is not order:
                    continue
                buffer, write = user.args[0], user
            elif (gather := row_gather(user)) is not None and gather[0] is value and sort_order(gather[1]) is order:
                buffer, write = user, None
            else:
                continue
            for view in buffer.users:
                shape = shape_of(view)
                if view is write or not (is_method_call(view, *VIEW_METHODS) and shape and len(shape) == 3):
                    continue
                found = weighted_route_sum(view)
                if found is not None and found[2] == 1 and same_size(shape[1], top_k):
                    return found[1], found[0]
    return None


def users_through_views(n: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """``(user, the view of n it reads)`` for every non-view user of ``n`` or of views of ``n`` (views:
    ``VIEW_METHODS``, ``VIEW_FUNCTIONS``, ``contiguous``)."""
    out: list[tuple[fx.Node, fx.Node]] = []
    todo = [n]
    while todo:
        m = todo.pop()
        for u in m.users:
            if (is_method_call(u, *VIEW_METHODS, "contiguous") or is_call(u, *VIEW_FUNCTIONS)) and u.args[0] is m:
                todo.append(u)
            else:
                out.append((u, m))
    return out


def forward_through(n: fx.Node, methods: Sequence[str]) -> list[fx.Node]:
    """``n`` and every node reached from it through single-input casts named in ``methods``."""
    out, stack = [], [n]
    while stack:
        m = stack.pop()
        out.append(m)
        stack.extend(u for u in m.users if is_method_call(u, *methods) and u.args[0] is m)
    return out


def split_leaves(n: object) -> list[fx.Node] | None:
    """The ``.item()`` SymInts a split size adds up (``torch.sym_sum``, ``+``), else None."""
    if is_item(n):
        return [n]
    if is_call(n, torch.sym_sum):
        out: list[fx.Node] = []
        for a in as_list(n.args[0]):
            leaves = split_leaves(a)
            if leaves is None:
                return None
            out += leaves
        return out
    if is_call(n, operator.add):
        a, b = split_leaves(n.args[0]), split_leaves(n.args[1])
        return None if a is None or b is None else a + b
    return None


def flat_index_of_item(item: fx.Node) -> tuple[fx.Node, int] | None:
    """``(t, k)`` for ``t[k].item()`` on a 1-D tensor t, else None."""
    g = item.args[0] if item.op == "call_method" else None
    if not (isinstance(g, fx.Node) and is_call(g, operator.getitem)):
        return None
    t, k = g.args
    if isinstance(t, fx.Node) and isinstance(k, int) and len(shape_of(t) or ()) == 1:
        return t, k
    return None


def router_num_experts(topk_ids: fx.Node) -> int | torch.SymInt | None:
    """E from ``topk(scores_TE, K)[1]`` behind the ids (through views), when the ids come from a topk (a SymInt
    under dynamic shapes: compare it with ``same_size``)."""
    n = peel(topk_ids, VIEW_METHODS, VIEW_FUNCTIONS)
    if is_call(n, operator.getitem) and n.args[1] == 1:
        topk = n.args[0]
        if is_call(topk, torch.topk) or is_method_call(topk, "topk"):
            shape = shape_of(topk.args[0])
            if shape:
                return shape[-1]
    return None


def is_to_local(n: fx.Node) -> bool:
    """``DTensor.to_local()``: a ``call_method`` (torch 2.13), or through torch 2.11 a call of the function Dynamo
    makes on the fly for it, named ``prim_to_local`` (docs/ARCHITECTURE.md section 5)."""
    if n.op == "call_function" and getattr(n.target, "__name__", None) == "prim_to_local":
        return True
    return is_method_call(n, "to_local")


def is_weight_source(n: fx.Node) -> bool:
    """A tensor F may take from outside as expert weight: a placeholder / get_attr, or ``p.to_local()`` of one."""
    if n.op in ("placeholder", "get_attr"):
        return isinstance(node_value(n), torch.Tensor) or n.op == "get_attr"
    return is_to_local(n) and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder"


def is_symbolic_arith(n: fx.Node) -> bool:
    """Pure SymInt/SymBool arithmetic (``sym_sum``, ``+``, ``>=``, ``==``...): what Dynamo's asserts compare."""
    if n.op != "call_function" or is_collective(n) or is_item(n) or is_assert(n) or is_mutator(n):
        return False
    return isinstance(node_value(n), (torch.SymInt, torch.SymBool, int, bool))

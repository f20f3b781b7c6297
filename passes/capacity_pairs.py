"""capacity_pairs: the ring's (expert id, score) pairs of a capacity region, inserted as graph nodes.

A capacity region (``capacity_match``) has no top-k ids and scores: its gate hands the block two ``(S, E, C)``
masks. The ring runs over the pairs the dispatch mask keeps, each with the combine weight of its slot:

    kept_TE   = dispatch_mask_SEC.any(-1)                 # (s, e) dispatched: at most K per token
    keep_TE   = kept_TE.to(combine_weights.dtype)
    ids_TK    = torch.topk(keep_TE, K, dim=-1)[1]         # the kept experts first, then any others
    scores_TE = combine_weights_SEC.sum(-1) * keep_TE     # the one slot's weight; 0 where not dispatched
    scores_TK = torch.gather(scores_TE, 1, ids_TK)

Why this is the original's math, forward and backward: each slot holds at most one token, so the original's
``y[s] = sum_{e,c} cw[s,e,c] * F_e(slot (e, c))`` only reads slots that token s occupies (``cw`` is 0 elsewhere,
by the gate's construction ``gates * mask * one_hot(location)``), which is ``sum_e scores[s, e] * F_e(x[s])``
over kept pairs. A token with fewer than K kept pairs (dropped over capacity) carries pairs of score 0: they add
``F(x) * 0`` to y, and their score gradient is masked to 0 by ``keep_TE``, as the original's is by the gate's
mask. Kept pairs get ``d scores[s, e] = F_e(x[s]) . dy[s]`` on every slot ``c`` of ``cw[s, e, :]``; the gate reads
``cw`` only through ``gates[s, e] * one_hot(location)[c]``, so ``d gates`` is the original's. Experts with biases
do not change this (empty slots compute ``F(0)`` in the original, biases and all, times a combine weight of 0):
the grouped experts add them to the kept pairs' rows only.

Legend: T tokens (DeepSpeed's s), E experts, C capacity slots per expert, K the gate's top-k.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from relay_compile.passes.fx_nodes import node_value

__all__ = ["insert_capacity_pairs"]


def _fake_call(target: Callable[..., Any] | str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The node's value computed on its inputs' fake values (in their fake mode)."""
    values, kw_values = fx.node.map_arg((args, kwargs), node_value)
    fake_mode = next((v.fake_mode for v in pytree.tree_leaves(values) if hasattr(v, "fake_mode")), None)
    assert fake_mode is not None, f"capacity_pairs: the inputs of {target} have no fake values"
    with fake_mode:
        if isinstance(target, str):
            return getattr(values[0], target)(*values[1:], **kw_values)
        return target(*values, **kw_values)


def _insert(graph: fx.Graph, like: fx.Node, target: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> fx.Node:
    """A new node at the insertion point, with its fake value and ``like``'s source location."""
    node = graph.create_node("call_method" if isinstance(target, str) else "call_function", target, args, kwargs)
    node.meta["val"] = node.meta["example_value"] = _fake_call(target, args, kwargs)
    for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    return node


def insert_capacity_pairs(
    output: fx.Node, dispatch_mask: fx.Node, combine_weights: fx.Node, top_k: int
) -> tuple[fx.Node, fx.Node]:
    """Insert ``(ids_TK, scores_TK)`` of a capacity region at the graph's insertion point (module docstring);
    returns the nodes. ``output``: the region's output (the new nodes take its source location).

    The caller sets the insertion point after ``dispatch_mask`` and ``combine_weights``.
    """
    graph, y = output.graph, output
    kept_TE = _insert(graph, y, "any", dispatch_mask, -1)
    # K was read from the gate's code: a token with more kept pairs would lose some, so fail loudly instead.
    per_token = _insert(graph, y, "sum", kept_TE, -1)
    fits = _insert(graph, y, "all", _insert(graph, y, operator.le, per_token, top_k))
    _insert(graph, y, torch._assert_async, fits, f"relaymoe: a token keeps more than K={top_k} experts in "
                                                 f"the capacity region of {y.name}; report it with the model's gate")
    keep_TE = _insert(graph, y, "to", kept_TE, node_value(combine_weights).dtype)
    ids_TK = _insert(graph, y, operator.getitem, _insert(graph, y, torch.topk, keep_TE, top_k, dim=-1), 1)
    weight_TE = _insert(graph, y, "sum", combine_weights, -1)
    scores_TE = _insert(graph, y, operator.mul, weight_TE, keep_TE)
    scores_TK = _insert(graph, y, torch.gather, scores_TE, 1, ids_TK)
    return ids_TK, scores_TK

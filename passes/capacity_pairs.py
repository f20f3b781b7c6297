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

DeepSpeed from 0.19.4 on routes sparsely: its gate hands the block each route's expert and slot, ``(K, T)``,
and the buffers are gathers (``capacity_match``'s slot form). The pairs are read from the routes' flat slots
``s = e * C + c`` (``E * C`` parks a route dropped over capacity) and gates (``insert_slot_pairs``):

    keep_TK   = slots_TK < E * C                          # e < E
    assert (slot_tokens[slots_TK] == t) where keep_TK     # the dispatch put token t in its route's slot
    scores_TE = zeros(T, E).scatter_add(1, slots_TK // C, gates_TK * keep_TK)     # gates per (token, expert)
    ids_TK    = topk(zeros(T, E).scatter_add(1, slots_TK // C, keep_TK), K)[1]    # K distinct, kept first
    scores_TK = gather(scores_TE, 1, ids_TK)

The original reads token t's output of route k from slot ``slots[k, t]``, which holds ``F_e(x[slot_tokens[s]])``:
with the assert (which holds when each slot holds one token: slots come from a cumsum) that is ``F_e(x[t])``,
and dropped routes read the combine's zero pad row. So ``y[t] = sum_k scores[t, k] * F_{ids[t, k]}(x[t])``, and
the gradients are the original's as above (a dropped route's score gradient is 0 in both).

Legend: T tokens (DeepSpeed's s), E experts, C capacity slots per expert, K the gate's top-k.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from relay_compile.passes.fx_nodes import node_value

__all__ = ["MaskPairs", "SlotPairs", "insert_capacity_pairs", "insert_slot_pairs"]


def _fake_call(target: Callable[..., Any] | str, args: tuple[Any, ...], kwargs: dict[str, Any], like: fx.Node) -> Any:
    """The node's value computed on its inputs' fake values (in their fake mode, else ``like``'s: a factory)."""
    values, kw_values = fx.node.map_arg((args, kwargs), node_value)
    leaves = [*pytree.tree_leaves(values), *pytree.tree_leaves(kw_values), node_value(like)]
    fake_mode = next((v.fake_mode for v in leaves if hasattr(v, "fake_mode")), None)
    assert fake_mode is not None, f"capacity_pairs: the inputs of {target} have no fake values"
    with fake_mode:
        if isinstance(target, str):
            return getattr(values[0], target)(*values[1:], **kw_values)
        return target(*values, **kw_values)


def _insert(graph: fx.Graph, like: fx.Node, target: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> fx.Node:
    """A new node at the insertion point, with its fake value and ``like``'s source location."""
    node = graph.create_node("call_method" if isinstance(target, str) else "call_function", target, args, kwargs)
    node.meta["val"] = node.meta["example_value"] = _fake_call(target, args, kwargs, like)
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


def insert_slot_pairs(
    output: fx.Node, slots: fx.Node, gates: fx.Node, slot_tokens: fx.Node, capacity: int | fx.Node,
    num_experts: int, routes_first: bool,
) -> tuple[fx.Node, fx.Node]:
    """Insert ``(ids_TK, scores_TK)`` of a sparse-route capacity region (module docstring) at the graph's
    insertion point; ``slots``/``gates``: ``(K, T)`` if ``routes_first`` else ``(T, K)``; ``capacity``: C, an int
    or the node of its SymInt (C read from a tensor)."""
    graph, y = output.graph, output
    if routes_first:
        slots, gates = _insert(graph, y, "t", slots), _insert(graph, y, "t", gates)
    top_k = node_value(slots).shape[1]
    slots_TK = _insert(graph, y, "long", slots)
    experts_TK = _insert(graph, y, torch.div, slots_TK, capacity, rounding_mode="floor")
    keep_TK = _insert(graph, y, operator.lt, experts_TK, num_experts)
    routed_TK = _insert(graph, y, torch.where, keep_TK, experts_TK, 0)
    # The identity the rewrite rests on, checked on this step's routes (a K*T gather, no host sync).
    tokens_TK = _insert(graph, y, operator.getitem, slot_tokens, _insert(graph, y, torch.where, keep_TK, slots_TK, 0))
    num_tokens = _insert(graph, y, "size", slots_TK, 0)
    t_T1 = _insert(graph, y, "unsqueeze", _insert(graph, y, torch.arange, num_tokens,
                                                  device=node_value(slots_TK).device), -1)
    holds = _insert(graph, y, operator.or_, _insert(graph, y, operator.eq, tokens_TK, t_T1),
                    _insert(graph, y, operator.invert, keep_TK))
    _insert(graph, y, torch._assert_async, _insert(graph, y, "all", holds),
            f"relaymoe: a route of the capacity region of {y.name} reads a slot its token was not dispatched to "
            "(two routes share a slot); report it with the model's gate")
    # A dropped route has no expert (routed_TK names expert 0 for it, score 0), so a token's routes may name one
    # expert twice: sum each token's gates per expert, then take K distinct experts, kept first, as the mask form
    # does (insert_capacity_pairs), so the ring's pairs are one per (token, expert).
    keep = _insert(graph, y, "to", keep_TK, node_value(gates).dtype)
    kept_TE = _insert(graph, y, "scatter_add", _insert(graph, y, "new_zeros", gates, (num_tokens, num_experts)), 1,
                      routed_TK, keep)
    scores_TE = _insert(graph, y, "scatter_add", _insert(graph, y, "new_zeros", gates, (num_tokens, num_experts)), 1,
                        routed_TK, _insert(graph, y, operator.mul, gates, keep))
    ids_TK = _insert(graph, y, operator.getitem, _insert(graph, y, torch.topk, kept_TE, top_k, dim=-1), 1)
    return ids_TK, _insert(graph, y, torch.gather, scores_TE, 1, ids_TK)


@dataclass(frozen=True)
class MaskPairs:
    """Where a capacity region's pairs come from: the gate's two ``(S, E, C)`` masks (GShard, DeepSpeed up to
    0.19.3, fairseq)."""

    dispatch_mask: fx.Node  # boolean: the pairs kept
    combine_weights: fx.Node  # floating: the combine einsum's operand

    def inputs(self) -> dict[str, fx.Node]:
        return {"dispatch_mask": self.dispatch_mask, "combine_weights": self.combine_weights}

    def insert(self, output: fx.Node, top_k: int) -> tuple[fx.Node, fx.Node]:
        return insert_capacity_pairs(output, self.dispatch_mask, self.combine_weights, top_k)


@dataclass(frozen=True)
class SlotPairs:
    """Where a capacity region's pairs come from: each route's flat slot and gate (DeepSpeed from 0.19.4 on,
    ``_route_slots`` / ``_sparse_encode`` / ``_sparse_decode``), and the dispatch's slot -> token map."""

    slots: fx.Node  # integer (K, T) (``routes_first``) or (T, K): e * C + c, E * C for a dropped route
    gates: fx.Node  # floating, slots' shape: what the combine multiplies each route's output by
    slot_tokens: fx.Node  # (E * C,) integer: the token the dispatch gathered into each slot
    capacity: int | fx.Node  # C (a node where C is read from a tensor)
    num_experts: int
    routes_first: bool

    def inputs(self) -> dict[str, fx.Node]:
        return {"slots": self.slots, "gates": self.gates, "slot_tokens": self.slot_tokens}

    def insert(self, output: fx.Node, top_k: int) -> tuple[fx.Node, fx.Node]:
        return insert_slot_pairs(output, self.slots, self.gates, self.slot_tokens, self.capacity, self.num_experts,
                                 self.routes_first)

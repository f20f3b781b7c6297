"""slot_routes: recognizers of a sparse-route capacity dispatch and combine (DeepSpeed from 0.19.4 on).

DeepSpeed's ``MOELayer`` (``sharded_moe.py``: ``_route_slots``, ``_sparse_encode``, ``_sparse_decode``) no longer
builds ``(S, E, C)`` masks: its gate returns each route's expert, slot and gate, ``(K, T)``, and the capacity
buffers are gathers (names are roles):

    slots_KT     = where(ids_KT >= 0, ids_KT * C + locations_KT, E * C)         # E * C parks a dropped route
    slot_tokens  = full((E * C + 1,), T).scatter_(0, slots_KT.flatten(), arange(T).expand_as(slots_KT).flatten())
    send_ECH     = cat([x_TH, zeros(1, H)]).index_select(0, slot_tokens[:-1]).view(E, C, H)
    ...          = all_to_all(send) -> F -> all_to_all(out) = back
    routed_KTH   = cat([back.view(E * C, H), zeros(1, H)]).index_select(0, slots_KT.flatten()).view(K, T, H)
    y_TH         = (routed_KTH * gates_KT.unsqueeze(-1)).sum(0)                 # then .to(x.dtype)

The recognizers read no more than the buffers' dataflow: how the gate computed the slots, and how the dispatch's
slot -> token map was built, do not matter, because the rewrite checks at run time that every kept route's slot
holds its token (``capacity_pairs.insert_slot_pairs``). Like ``roles``, they return what a form binds or None,
never refuse and never mutate; ``capacity_match`` decides what a missing form means.

Legend: T tokens, H hidden, E experts, C capacity slots per expert, K routes per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from relay_compile.passes.fx_nodes import arg, as_list, dtype_of, is_call, is_method_call, same_size, shape_of
from relay_compile.passes.roles import (
    VIEW_FUNCTIONS,
    VIEW_METHODS,
    is_zeros,
    peel,
    row_gather,
    token_index,
    users_through_views,
    weighted_route_sum,
)

__all__ = ["SlotCombine", "SlotDispatch", "slot_combine", "slot_dispatch"]

_VIEWS = (*VIEW_METHODS, "contiguous")


@dataclass(frozen=True)
class SlotDispatch:
    """``x_pad.index_select(0, slot_tokens).view(E, C, H)``, ``x_pad`` being ``cat([x, pad])`` or ``x``."""

    gather: fx.Node
    x: fx.Node  # (T, H)
    slot_tokens: fx.Node  # (E * C,) integer
    capacity: int | fx.Node  # C as the buffer's view names it (a node of a SymInt where C is read from a tensor)


@dataclass(frozen=True)
class SlotCombine:
    """``(cat([back.view(E * C, H), 0]).index_select(0, slots.flatten()).view(A, B, H) * gates.unsqueeze(-1))
    .sum(d)``."""

    gather: fx.Node
    slots: fx.Node  # (A, B) integer
    gates: fx.Node  # (A, B) floating
    output: fx.Node  # the sum over the routes (T, H)
    routes_first: bool  # (A, B) = (K, T), summed over dim 0; else (T, K), summed over dim 1


def _is_cat0(n: object) -> bool:
    return (is_call(n, torch.cat, torch.concat, torch.concatenate) and len(as_list(n.args[0])) == 2
            and arg(n, 1, "dim", 0) == 0)


def _view_capacity(sent: object, gather: fx.Node) -> int | fx.Node | None:
    """C, dim 1 of the ``(E, C, H)`` view between ``gather`` and the sent value (its argument as written)."""
    n = sent
    while isinstance(n, fx.Node) and n is not gather:
        if is_method_call(n, "view", "reshape") or is_call(n, torch.reshape):
            dims = list(n.args[1:]) if n.op == "call_method" else as_list(n.args[1])
            if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
                dims = list(dims[0])
            if len(dims) == 3 and (isinstance(dims[1], fx.Node) or isinstance(dims[1], int) and dims[1] >= 0):
                return dims[1]
            return None
        n = n.args[0]
    return None


def slot_dispatch(sent: object) -> SlotDispatch | None:
    """The sparse-route dispatch an all-to-all sends (``sent``: its input), else None (module docstring).

    A gather by ``order // K`` is the top-k dispatch's ``x[order // K]``, not this."""
    if len(shape_of(sent) or ()) != 3:
        return None
    gather = peel(sent, _VIEWS, VIEW_FUNCTIONS)
    found = row_gather(gather) if isinstance(gather, fx.Node) else None
    if found is None:
        return None
    source, slot_tokens = found
    if token_index(slot_tokens) is not None or len(shape_of(slot_tokens) or ()) != 1:
        return None
    if dtype_of(slot_tokens) not in (torch.int64, torch.int32):
        return None
    x = source.args[0][0] if _is_cat0(source) else source
    capacity = _view_capacity(sent, gather)
    if not isinstance(x, fx.Node) or len(shape_of(x) or ()) != 2 or capacity is None:
        return None
    return SlotDispatch(gather=gather, x=x, slot_tokens=slot_tokens, capacity=capacity)


def _gathers_of(back: fx.Node) -> list[fx.Node]:
    """Row gathers of ``back`` through views, or of ``cat([back view, zeros])`` (the zero row dropped routes read)."""
    out: list[fx.Node] = []
    todo = [back]
    while todo:
        for user, view in users_through_views(todo.pop()):
            if _is_cat0(user) and user.args[0][0] is view and is_zeros(user.args[0][1]):
                todo.append(user)
            elif (found := row_gather(user)) is not None and found[0] is view:
                out.append(user)
    return out


def slot_combine(back: fx.Node, tokens: object) -> SlotCombine | None:
    """The sparse-route combine of ``back`` (the reverse all-to-all's result) into ``tokens`` rows, else None."""
    for gather in _gathers_of(back):
        found = row_gather(gather)
        assert found is not None
        slots = peel(found[1], _VIEWS, VIEW_FUNCTIONS)
        if not isinstance(slots, fx.Node) or len(shape_of(slots) or ()) != 2:
            continue
        routed = next((u for u in gather.users if len(shape_of(u) or ()) == 3), None)
        weighted = weighted_route_sum(routed) if routed is not None else None
        if weighted is None:
            continue
        gates, total, dim = weighted
        if tuple(shape_of(gates) or ()) != tuple(shape_of(slots) or ()):
            continue
        if not same_size((shape_of(slots) or ())[1 - dim], tokens):
            continue
        return SlotCombine(gather=gather, slots=slots, gates=gates, output=total, routes_first=dim == 0)
    return None

"""capacity_match: find capacity-based MoE regions (GShard, DeepSpeed, fairscale) in a Dynamo FX graph.

The idiom (DeepSpeed ``sharded_moe.py``: ``top2gating`` + ``MOELayer``; names are roles, not node names):

    locations  = cumsum(one_hot(argmax(gates)), dim=0) - 1             # each token's slot in its expert's buffer
    mask       = one_hot(...) * (locations < C)                         # tokens over capacity C are dropped
    combine_weights_TEC = gates * one_hot(location, C)                 # (T, E, C), 0 where not dispatched
    dispatch_mask_TEC   = combine_weights_TEC.bool()
    send_ECH   = einsum("sec,sm->ecm", dispatch_mask.type_as(x), x)     # every expert's capacity buffer (fairseq:
                                                                        # mm(mask.permute(1, 2, 0).view(E*C, T), x))
    recv       = wait(all_to_all_single(send, [E_l] * N, [E_l] * N))   # equal splits: (N, E_l, C, H) rows
    out        = F(recv, weights)                                       # the local experts on their buffers
    back       = wait(all_to_all_single(out, equal splits))             # (E, C, H): every expert's output
    y_TH       = einsum("sec,ecm->sm", combine_weights, back)

Drop decisions are local (the masks are computed before the dispatch, from this rank's tokens), so the block is
``y[t] = sum_e score[t, e] * F_e(x[t])`` over the pairs (t, e) that ``dispatch_mask`` keeps, with
``score[t, e] = sum_c combine_weights[t, e, c]``: a ring over those (token, expert) pairs computes the same,
and its rewrite (``capacity_pairs``) derives the pairs from the two masks, which stay in the graph.

Contract:
    Consumes a Dynamo graph and its floating-point all-to-alls. Never mutates it. ``find_capacity_regions``
    claims the all-to-alls whose input is a capacity dispatch (an ``einsum("sec,sm->ecm")`` or its mm form seen
    through views,
    or any equal-split all-to-all of something other than a row gather that answers no other all-to-all) and
    their combine partner; it returns one ``CapacityRegion`` per pair it understands, a ``RefusedRegion``
    (reason also logged as ``"match: skipped ..."``) per claimed all-to-all it does not, and the all-to-alls it
    did not claim, for the top-k matcher (``match``).
    Guarantees for a region: the dataflow above, with each slot holding at most one token (slots come from a
    cumsum over tokens), a 0/1 dispatch mask (a boolean tensor, cast), combine weights of the masks' shape,
    the gate's top-k ``K`` read from the graph (argmax / topk over the E experts), expert e on rank e // E_l
    (equal static splits of an e-major buffer), ``expert_fn`` a standalone copy of F whose inputs are the
    receive and expert weights, ``plan`` that F recognized as an FFN of experts (``expert_block``: F's shapes
    are the whole receive's, so it cannot run on a hop's rows; the rewrite lowers it and proves the lowering on
    a random receive, ``expert_lowering``), and ``nodes`` exactly what dies once ``output``'s uses go to a ring (the masks,
    the tokens and the weights excluded).
    Refuses: a grouped einsum (GShard's ``gsec``) or a batched-matmul dispatch, a dispatch operand that is not a
    boolean mask (scores applied before the experts), no capacity slots or top-k readable from the graph,
    unequal or symbolic splits, a capacity C or experts count that is not a constant, masks that are inputs of
    the graph (the gate across a graph break), F reading anything but the receive and weights, F that is not
    an FFN of experts (slot-mixing ops, per-expert norms), and region values used outside the region.

Pseudo-code:
    # Step 1: claim: token all-to-alls whose input, through views, is a capacity dispatch einsum (or another
    #         equal-split buffer, to refuse it by name).
    # Step 2: the combine partner: the closest token all-to-all downstream whose result, through views,
    #         feeds an einsum("sec,ecm->sm") as its (E, C, H) operand.
    # Step 3: the masks: the dispatch operand peels to a boolean (T, E, C) tensor; combine weights (T, E, C)
    #         floating; slots from a cumsum over tokens; K from the gate's argmax / topk.
    # Step 4: equal static splits, E = N * E_l, C constant.
    # Step 5: F = backward slice from the combine input down to the receive and the weights; copy it;
    #         recognize it as an FFN of experts (from its graph; the rewrite proves the lowering).
    # Step 6: what dies once the output is replaced; refuse if an all-to-all would survive.

Legend: T tokens (the einsums' s), H hidden, E experts, E_l experts per rank, N ranks, C capacity, K the gate's top-k.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import cast

import torch
import torch.fx as fx

from relay_compile.experts import GATED
from relay_compile.passes.capacity_pairs import MaskPairs, SlotPairs
from relay_compile.passes.expert_block import NotAnFFN, recognize_expert_ffn
from relay_compile.passes.expert_fn import copy_expert_fn, slice_expert_fn
from relay_compile.passes.fx_nodes import (
    all_to_all_args,
    ancestors,
    arg,
    as_list,
    block_shape,
    closest,
    dtype_of,
    is_call,
    is_method_call,
    shape_of,
    static_int,
    upstream_collectives,
    wait_end,
)
from relay_compile.passes.liveness import dead_after_replacing
from relay_compile.passes.refusals import Refusal, RefusedRegion
from relay_compile.passes.region import ExpertsInput
from relay_compile.passes.roles import (
    CAST_METHODS,
    VIEW_FUNCTIONS,
    VIEW_METHODS,
    peel,
    row_gather,
    users_through_views,
)
from relay_compile.passes.slot_routes import SlotDispatch, slot_combine, slot_dispatch
from relay_compile.runtime.block_shape import BlockShape
from relay_compile.runtime.ffn_plan import ExpertFFN
from relay_compile.runtime.region_fn import ExpertFnBinding
from relay_compile.runtime.specs import ScoresApplied

log = logging.getLogger(__name__)

__all__ = ["CapacityRegion", "find_capacity_regions"]

_EINSUM = (torch.einsum, torch.functional.einsum)
_VIEWS = (*VIEW_METHODS, "contiguous")
_BOOL_METHODS = ("bool",)


# ----------------------------------------------------------------------------------------------------------
# Record
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class CapacityRegion:
    """One capacity-based EP MoE block, understood well enough to run as a ring over its kept pairs.

    Nodes are those of the matched graph; ``expert_fn`` is a standalone copy (its own graph) of F on the
    receive ``(N * E_l, C, H)`` (rows source-major, then local expert, then slot), in any of F's views.
    """

    dispatch: fx.Node  # all_to_all_single of the (E, C, H) capacity buffers
    combine: fx.Node  # the reverse all_to_all_single
    recv: fx.Node  # end of the dispatch's wait chain: F's input
    back: fx.Node  # end of the combine's wait chain
    x: fx.Node  # tokens (T, H): what the dispatch reads
    pairs: MaskPairs | SlotPairs  # where the ring's (id, score) pairs come from (pinned: the rewrite reads them)
    output: fx.Node  # y (T, H): the combine
    weights: tuple[fx.Node, ...]
    expert_fn: fx.GraphModule  # F: recv, weights -> the combine's input
    binding: ExpertFnBinding
    plan: ExpertFFN  # F recognized as an FFN of experts (the rewrite lowers it and proves it on probe inputs)
    experts_per_rank: int
    capacity: int | None  # C; None where it is read from a tensor (DeepSpeed's drop_tokens=False)
    top_k: int  # K: the gate's choices per token (kept pairs per token are at most K)
    group_name: str
    group_size: int
    nodes: frozenset[fx.Node]  # what dies once output's uses go elsewhere
    output_aliases: tuple[fx.Node, ...] = ()
    # The combine weights multiply the experts' outputs (a dispatch of scaled tokens is refused).
    scores_applied: ScoresApplied = "after"
    # F reads the whole (N * E_l, C, H) receive: it runs only lowered onto grouped experts.
    experts_input: ExpertsInput = "capacity"

    def block_shape(self) -> BlockShape:
        """Sizes of the block on this rank, as the top-k regions report them (K = the gate's top-k)."""
        return block_shape(
            self.x, self.weights, top_k=self.top_k, experts_per_rank=self.experts_per_rank,
            group_size=self.group_size, matrices_per_expert=3 if self.plan.activation in GATED else 2,
        )

    def inputs(self) -> dict[str, fx.Node]:
        return self.pairs.inputs()

    def first_collective(self) -> fx.Node:
        return self.dispatch

    def insert_pairs(self) -> tuple[fx.Node, fx.Node]:
        """The (id, score) pairs derived from the masks or the routes' slots (``capacity_pairs``)."""
        return self.pairs.insert(self.output, self.top_k)

    def idiom(self) -> str:
        if isinstance(self.pairs, SlotPairs):
            form = "sparse routes: tokens gathered by slot, outputs gathered back and summed with the gates"
        else:
            form = "(S, E, C) masks: einsum / mm dispatch and combine"
        return f"capacity: {form}, C {'read from a tensor' if self.capacity is None else 'constant'}"

    def describe(self) -> str:
        return (
            f"capacity MoE region dispatch={self.dispatch.name} combine={self.combine.name} "
            f"output={self.output.name} (group {self.group_name!r} of {self.group_size}, E_l={self.experts_per_rank}, "
            f"C={'dynamic' if self.capacity is None else self.capacity}, K={self.top_k}, {len(self.weights)} weights, "
            f"F: {len(self.expert_fn.graph.nodes)} nodes)"
        )


# ----------------------------------------------------------------------------------------------------------
# Einsums, and their mm form (fairseq)
# ----------------------------------------------------------------------------------------------------------


def _einsum_terms(n: object) -> tuple[list[str], str, list[fx.Node]] | None:
    """``(input subscripts, output subscripts, operands)`` of a two-operand ``torch.einsum`` node, else None."""
    if not is_call(n, *_EINSUM) or not isinstance(n.args[0], str):
        return None
    operands = list(n.args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    equation = n.args[0].replace(" ", "")
    if "->" not in equation or "." in equation or len(operands) != 2:
        return None
    lhs, out = equation.split("->")
    terms = lhs.split(",")
    nodes = [o for o in operands if isinstance(o, fx.Node)]
    if len(terms) != 2 or len(nodes) != 2:
        return None
    return terms, out, nodes


def _dispatch_einsum(n: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(mask operand, x)`` of ``einsum("sec,sm->ecm", mask, x)`` (any letters, either operand order)."""
    terms = _einsum_terms(n)
    if terms is None:
        return None
    (a, b), out, operands = terms
    for (mask_t, x_t), (mask, x) in (((a, b), operands), ((b, a), operands[::-1])):
        if len(mask_t) == 3 and len(x_t) == 2 and x_t[0] == mask_t[0] and out == mask_t[1:] + x_t[1]:
            return mask, x
    return None


def _combine_einsum(n: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(combine weights operand, expert output operand)`` of ``einsum("sec,ecm->sm", cw, eo)``."""
    terms = _einsum_terms(n)
    if terms is None:
        return None
    (a, b), out, operands = terms
    for (cw_t, eo_t), (cw, eo) in (((a, b), operands), ((b, a), operands[::-1])):
        if len(cw_t) == 3 and len(eo_t) == 3 and eo_t[:2] == cw_t[1:] and out == cw_t[0] + eo_t[2]:
            return cw, eo
    return None


def _mm_operands(n: object) -> tuple[fx.Node, fx.Node] | None:
    """The two 2-D operands of ``torch.mm(a, b)`` / ``a.mm(b)`` / ``a @ b``, else None."""
    if not (is_call(n, torch.mm, torch.matmul, operator.matmul) or is_method_call(n, "mm", "matmul")):
        return None
    a, b = (n.args + (None, None))[:2]
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node) and len(n.args) == 2):
        return None
    return (a, b) if len(shape_of(a) or ()) == 2 and len(shape_of(b) or ()) == 2 else None


def _dispatch_mm(n: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(mask operand, x)`` of fairseq's ``mm(mask.to(x.dtype).permute(1, 2, 0).reshape(E * C, T), x)``."""
    operands = _mm_operands(n)
    if operands is None:
        return None
    permuted = peel(operands[0], _VIEWS, VIEW_FUNCTIONS)
    if not (is_method_call(permuted, "permute") or is_call(permuted, torch.permute)):
        return None
    order = as_list(permuted.args[1]) if len(permuted.args) == 2 else list(permuted.args[1:])
    mask = permuted.args[0]
    if order != [1, 2, 0] or not isinstance(mask, fx.Node) or len(shape_of(mask) or ()) != 3:
        return None
    return mask, operands[1]


def _combine_mm(n: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(combine weights (T, E, C), expert output view)`` of fairseq's
    ``combine_weights.view(T, E * C).mm(expert_output.view(E * C, M))``."""
    operands = _mm_operands(n)
    if operands is None:
        return None
    cw = peel(operands[0], _VIEWS, VIEW_FUNCTIONS)
    return (cw, operands[1]) if isinstance(cw, fx.Node) and len(shape_of(cw) or ()) == 3 else None


def _dispatch_operands(send: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(mask operand, x)`` of a capacity dispatch (einsum or mm), else None."""
    return _dispatch_einsum(send) or _dispatch_mm(send)


def _dispatch_of(a2a: fx.Node) -> fx.Node | None:
    """The capacity dispatch (einsum or mm) an all-to-all sends (through views), else None."""
    send = peel(all_to_all_args(a2a).input, _VIEWS, VIEW_FUNCTIONS)
    return send if isinstance(send, fx.Node) and _dispatch_operands(send) is not None else None


def _sends_capacity_form(a2a: fx.Node) -> bool:
    """The all-to-all sends a capacity dispatch this module reads: einsum, mm or sparse routes."""
    return _dispatch_of(a2a) is not None or slot_dispatch(all_to_all_args(a2a).input) is not None


def _is_capacity_dispatch(a2a: fx.Node) -> bool:
    """Step 1: an einsum, mm or sparse-route dispatch, or an equal-split all-to-all of something other than a row
    gather (a capacity buffer written another way, to refuse by name: GShard's grouped ``gsec`` einsum, a batched
    matmul)."""
    if _sends_capacity_form(a2a):
        return True
    _, out_splits, in_splits, _ = all_to_all_args(a2a)
    sizes = [static_int(s) for s in (*out_splits, *in_splits)]
    send = peel(all_to_all_args(a2a).input, _VIEWS, VIEW_FUNCTIONS)
    return bool(sizes) and None not in sizes and len(set(sizes)) == 1 and not (
        isinstance(send, fx.Node) and row_gather(send) is not None
    )


# ----------------------------------------------------------------------------------------------------------
# Steps 2-4: the combine, the masks, the sizes
# ----------------------------------------------------------------------------------------------------------


def _combine_side(dispatch: fx.Node, combine: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node]:
    """Step 2: ``(back, output einsum, combine weights operand)``."""
    back = wait_end(combine)
    for user, view in users_through_views(back):
        found = _combine_einsum(user) or _combine_mm(user)
        if found is not None and found[1] is view:
            return back, user, found[0]
    raise Refusal(dispatch, f"the result of {combine.name} does not feed an einsum('sec,ecm->sm', combine_weights, "
                            "expert_output) or its mm form (another reduction)")


def _bool_mask(dispatch: fx.Node, operand: fx.Node) -> fx.Node:
    """Step 3: the boolean ``(T, E, C)`` tensor the dispatch operand casts (the kept pairs)."""
    mask = peel(operand, CAST_METHODS)
    if isinstance(mask, fx.Node) and mask.op == "placeholder":
        raise Refusal(dispatch, f"the dispatch mask {mask.name} is an input of this graph: the gate is in another "
                                "graph (a graph break between gate and dispatch, e.g. one_hot(locations, C) with C "
                                "read from a tensor, as DeepSpeed's drop_tokens=False does after its all_reduce; "
                                "TORCH_LOGS=graph_breaks shows where). The ring needs the gate's slots and top-k in "
                                "the same graph: compute C as a Python int (an upper bound such as S drops nothing)")
    if is_method_call(mask, *_BOOL_METHODS) or dtype_of(mask) == torch.bool:
        return mask  # type: ignore[return-value]
    name = getattr(mask, "name", mask)
    raise Refusal(dispatch, f"the dispatch einsum's mask {name} is not a boolean mask cast to the tokens' dtype "
                            "(scores applied before the experts?); the ring applies the combine weights after F")


def _top_k(dispatch: fx.Node, mask: fx.Node, num_experts: int) -> int:
    """Step 3: the gate's choices per token: argmax / max over the experts (1 each), topk(k) (k each).

    An overcount only adds pairs of score 0; an undercount (a choice written another way) would lose pairs,
    which the rewrite's ``_assert_async`` on the kept pairs per token turns into an error at run time.
    """
    behind = ancestors([mask])
    if not any((is_call(n, torch.cumsum) or is_method_call(n, "cumsum")) and arg(n, 1, "dim") == 0
               for n in behind):
        raise Refusal(dispatch, f"no capacity slots behind the dispatch mask {mask.name} (a cumsum over tokens): a "
                                "slot may hold more than one token")
    k = 0
    for n in behind:
        scores = shape_of(n.args[0]) if n.args else None
        if scores is None or len(scores) != 2 or static_int(scores[1]) != num_experts:
            continue
        if (is_call(n, torch.argmax, torch.max) or is_method_call(n, "argmax", "max")) and arg(n, 1, "dim") in (1, -1):
            k += 1
        elif (is_call(n, torch.topk) or is_method_call(n, "topk")) and arg(n, 2, "dim", -1) in (1, -1):
            k += static_int(arg(n, 1, "k")) or 0
    if not 1 <= k <= num_experts:
        raise Refusal(dispatch, f"the gate's top-k is not readable from the graph (argmax / topk over the "
                                f"{num_experts} experts behind {mask.name} choose {k} per token)")
    return k


def _masks(
    dispatch: fx.Node, mask_operand: fx.Node, cw: fx.Node, x: fx.Node, output: fx.Node
) -> tuple[fx.Node, int, int, int]:
    """Step 3: ``(boolean mask, E, C, K)``, with the shapes and dtypes of the masks, tokens and output checked."""
    mask = _bool_mask(dispatch, mask_operand)
    mask_shape, x_shape = shape_of(mask), shape_of(x)
    dims = [static_int(d) for d in mask_shape or ()]
    if len(dims) != 3 or None in dims:
        raise Refusal(dispatch, f"the dispatch mask {mask.name} has shape {mask_shape}, not a constant (S, E, C)")
    tokens, num_experts, capacity = cast(list[int], dims)
    if [static_int(d) for d in shape_of(cw) or ()] != dims or not (dtype_of(cw) or torch.int64).is_floating_point:
        raise Refusal(dispatch, f"the combine weights {cw.name} are not floating point of the mask's shape "
                                f"{mask_shape}")
    if x_shape is None or len(x_shape) != 2 or static_int(x_shape[0]) != tokens:
        raise Refusal(dispatch, f"the dispatched tokens {x.name} have shape {x_shape}, not (S={tokens}, H)")
    if tuple(shape_of(output) or ()) != tuple(x_shape) or dtype_of(output) != dtype_of(x):
        raise Refusal(dispatch, f"the block output {output.name} is {dtype_of(output)}{shape_of(output)}, the tokens "
                                f"{dtype_of(x)}{x_shape}; the ring returns the tokens' type")
    return mask, num_experts, capacity, _top_k(dispatch, mask, num_experts)


def _equal_splits(dispatch: fx.Node, a2a: fx.Node, group_size: int) -> None:
    """Step 4: equal constant splits of dim 0 (what each rank sends is a contiguous 1/N of the buffer)."""
    _, out_splits, in_splits, _ = all_to_all_args(a2a)
    dim0 = static_int((shape_of(all_to_all_args(a2a).input) or (None,))[0])
    sizes = {static_int(s) for s in (*out_splits, *in_splits)}
    if dim0 is None or len(out_splits) != group_size or len(sizes) != 1 or sizes != {dim0 // group_size}:
        raise Refusal(dispatch, f"{a2a.name} does not split its first dimension ({dim0}) equally over {group_size} "
                                f"ranks with constant sizes (splits {out_splits}, {in_splits})")


def _recognized_experts(dispatch: fx.Node, fn: fx.GraphModule, binding: ExpertFnBinding, e_l: int) -> ExpertFFN:
    """Step 5: F recognized as an FFN of experts, from its graph. F itself cannot run on a hop's rows (its shapes
    are the whole (N * E_l, C, H) receive's), so an F that is not an FFN of experts refuses the region."""
    try:
        return recognize_expert_ffn(fn, binding, e_l)
    except NotAnFFN as e:
        raise Refusal(dispatch, f"the capacity experts are not recognized as an FFN of experts ({e}); the ring runs "
                                "capacity experts only on grouped GEMMs") from None


# ----------------------------------------------------------------------------------------------------------
# One region
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Form:
    """What one dispatch form binds (steps 2-3): the tokens, the block output, the pairs and the sizes."""

    send: fx.Node  # the dispatch einsum / mm / gather
    x: fx.Node
    back: fx.Node
    output: fx.Node
    pairs: MaskPairs | SlotPairs
    num_experts: int
    capacity: int | None
    top_k: int


def _mask_form(dispatch: fx.Node, combine: fx.Node, send: fx.Node) -> _Form:
    """Steps 2-3 of an einsum or mm dispatch: the combine einsum, the masks and K."""
    operands = _dispatch_operands(send)
    assert operands is not None
    mask_operand, x = operands
    back, output, cw = _combine_side(dispatch, combine)
    mask, num_experts, capacity, top_k = _masks(dispatch, mask_operand, cw, x, output)
    return _Form(send=send, x=x, back=back, output=output, pairs=MaskPairs(mask, cw), num_experts=num_experts,
                 capacity=capacity, top_k=top_k)


def _slot_form(dispatch: fx.Node, combine: fx.Node, sent: SlotDispatch) -> _Form:
    """Steps 2-3 of a sparse-route dispatch (``slot_routes``): the combine's gather-and-sum, the routes' slots and
    gates, E, C and K."""
    x, back = sent.x, wait_end(combine)
    found = slot_combine(back, (shape_of(x) or (None,))[0])
    if found is None:
        raise Refusal(dispatch, f"the result of {combine.name} is not gathered back by the routes' slots and summed "
                                "with their gates, (cat([back.view(E * C, H), zeros]).index_select(0, slots.flatten())"
                                ".view(K, T, H) * gates.unsqueeze(-1)).sum(0), as DeepSpeed's _sparse_decode does")
    output = found.output
    if dtype_of(output) != dtype_of(x) and len(output.users) == 1 and is_method_call(next(iter(output.users)),
                                                                                      *CAST_METHODS):
        output = next(iter(output.users))  # the sum is in the gates' dtype (fp32), then cast to the tokens'
    if tuple(shape_of(output) or ()) != tuple(shape_of(x) or ()) or dtype_of(output) != dtype_of(x):
        raise Refusal(dispatch, f"the block output {output.name} is {dtype_of(output)}{shape_of(output)}, the tokens "
                                f"{dtype_of(x)}{shape_of(x)}; the ring returns the tokens' type")
    num_experts = static_int((shape_of(all_to_all_args(dispatch).input) or (None,))[0])
    top_k = static_int((shape_of(found.slots) or (None, None))[0 if found.routes_first else 1])
    if num_experts is None or top_k is None:
        raise Refusal(dispatch, f"the experts ({shape_of(all_to_all_args(dispatch).input)}) or the routes per "
                                f"token ({shape_of(found.slots)}) of {dispatch.name} are not constant")
    pairs = SlotPairs(slots=found.slots, gates=found.gates, slot_tokens=sent.slot_tokens, capacity=sent.capacity,
                      num_experts=num_experts, routes_first=found.routes_first)
    capacity = sent.capacity if isinstance(sent.capacity, int) else static_int(sent.capacity)
    return _Form(send=sent.gather, x=x, back=back, output=output, pairs=pairs, num_experts=num_experts,
                 capacity=capacity, top_k=top_k)


def _form(dispatch: fx.Node, combine: fx.Node) -> _Form:
    """Steps 2-3 by the form of what the dispatch sends."""
    send = _dispatch_of(dispatch)
    if send is not None:
        return _mask_form(dispatch, combine, send)
    sent = slot_dispatch(all_to_all_args(dispatch).input)
    if sent is not None:
        return _slot_form(dispatch, combine, sent)
    sent = peel(all_to_all_args(dispatch).input, _VIEWS, VIEW_FUNCTIONS)
    raise Refusal(dispatch, f"the equal-split all_to_all {dispatch.name} sends {getattr(sent, 'name', sent)}, "
                            "not einsum('sec,sm->ecm', dispatch_mask, x), its mm form, nor a gather of the tokens by "
                            "slot (GShard's grouped 'gsec' einsum and batched matmuls are not rewritten)")


def _match_capacity_region(gm: fx.GraphModule, dispatch: fx.Node, combine: fx.Node,
                           weak: set[fx.Node]) -> CapacityRegion:
    group_name, group_size = all_to_all_args(dispatch).group_name, len(all_to_all_args(dispatch).output_split_sizes)
    if not isinstance(group_name, str) or all_to_all_args(combine).group_name != group_name:
        raise Refusal(dispatch, f"group names of {dispatch.name} and {combine.name} are not one constant string")
    # Steps 2-3: the combine, the pairs, E, C and K.
    form = _form(dispatch, combine)
    x, pinned = form.x, set(form.pairs.inputs().values())

    # Step 4: splits and placement.
    for a2a in (dispatch, combine):
        _equal_splits(dispatch, a2a, group_size)
    e_l, rem = divmod(form.num_experts, group_size)
    if rem or e_l < 1:
        raise Refusal(dispatch, f"{form.num_experts} experts do not divide over {group_size} ranks")
    if dtype_of(wait_end(dispatch)) != dtype_of(x):
        raise Refusal(dispatch, f"{dispatch.name} moves {dtype_of(wait_end(dispatch))}, the tokens are {dtype_of(x)}")

    # Step 5: F.
    forbidden = ancestors([all_to_all_args(dispatch).input, *pinned])
    body, used, weights = slice_expert_fn(dispatch, combine, {wait_end(dispatch): "rows"}, forbidden)
    recv = wait_end(dispatch)
    assert recv in used, f"capacity_match: F of {dispatch.name} does not read the receive {recv.name}"
    expert_fn, binding = copy_expert_fn(
        gm, body, all_to_all_args(combine).input, recv, None, [], weights, used, "source"
    )

    plan = _recognized_experts(dispatch, expert_fn, binding, e_l)

    # Step 6: what dies.
    dead = dead_after_replacing(form.output, {x, *pinned, *weights}, weak)
    for role, n in (("dispatch", dispatch), ("combine", combine), ("receive", recv), ("combine result", form.back),
                    ("dispatch buffer", form.send)):
        if n not in dead:
            users = ", ".join(u.name for u in n.users)
            raise Refusal(dispatch, f"the {role} {n.name} stays alive after the rewrite (a value of the region "
                                    f"is used outside it; users: {users})")
    for n in body:
        if n not in dead:
            raise Refusal(dispatch, f"F's {n.name} is used outside the region")
    return CapacityRegion(
        dispatch=dispatch, combine=combine, recv=recv, back=form.back, x=x, pairs=form.pairs, output=form.output,
        weights=tuple(weights), expert_fn=expert_fn, binding=binding, plan=plan, experts_per_rank=e_l,
        capacity=form.capacity, top_k=form.top_k, group_name=group_name, group_size=group_size,
        nodes=frozenset(dead),
    )


# ----------------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------------


def _partner(dispatch: fx.Node, token_a2as: list[fx.Node]) -> fx.Node | None:
    """Step 2: the token all-to-all whose input has ``dispatch`` as its closest upstream token all-to-all."""
    token_set = set(token_a2as)
    partners = [
        n for n in token_a2as
        if n is not dispatch and closest(upstream_collectives([all_to_all_args(n).input]) & token_set) == {dispatch}
    ]
    return partners[0] if len(partners) == 1 else None


def find_capacity_regions(
    gm: fx.GraphModule, token_a2as: list[fx.Node], weak: set[fx.Node]
) -> tuple[list[CapacityRegion], list[RefusedRegion], list[fx.Node]]:
    """``(regions, refusals, the all-to-alls not claimed)``, regions in program order (module docstring)."""
    regions: list[CapacityRegion] = []
    refused: list[RefusedRegion] = []
    claimed: set[fx.Node] = set()
    # Step 1: claim.
    for dispatch in token_a2as:
        if dispatch in claimed or not _is_capacity_dispatch(dispatch):
            continue
        upstream = closest(upstream_collectives([all_to_all_args(dispatch).input]) & set(token_a2as))
        if not _sends_capacity_form(dispatch) and upstream - claimed:
            continue  # the answer to an earlier all-to-all the top-k matcher pairs (or refuses)
        combine = _partner(dispatch, token_a2as)
        claimed |= {dispatch, *([combine] if combine is not None else [])}
        if combine is None:
            refused.append(RefusedRegion(dispatch, f"capacity dispatch {dispatch.name} has no reverse all_to_all "
                                                   "of the experts' output in this graph (a graph break?)"))
            continue
        try:
            regions.append(_match_capacity_region(gm, dispatch, combine, weak))
        except Refusal as r:
            refused.append(r.record())
    for refusal in refused:
        log.debug("match: skipped %s: %s", refusal.node.name, refusal.reason)
    return regions, refused, [n for n in token_a2as if n not in claimed]

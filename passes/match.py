"""match: find the all-to-all expert-parallel MoE regions of a Dynamo FX graph (docs/ARCHITECTURE.md, section 3).

Every a2a EP dispatcher we have seen computes, per rank (names here are roles, never node names):

    order   = argsort(topk_ids.flatten())                    # or sort(...)[1]
    send    = x[order // K]                                  # or x.index_select(0, order // K)
    counts  = exchange(local counts)                         # int a2a, or all_gather (+ constant slice)
    splits  = counts ... .item()                             # unbacked SymInts: per source, or per (source, expert)
    recv    = wait(all_to_all_single(send, splits, ...))     # dispatch
    out     = F(recv, counts, splits, weights)               # everything between the two all-to-alls
    back    = wait(all_to_all_single(out, ..., splits))      # combine
    y       = scatter_add(zeros[T, H], order // K, back * topk_scores.flatten()[order])

or, with the scores applied before the experts (DeepSpeed, Megatron's ``moe_apply_probs_on_input``):

    send    = x[order // K] * topk_scores.flatten()[order][:, None]     # casts around the product allowed
    y       = scatter_add(zeros[T, H], order // K, back)

Contract:
    Consumes a Dynamo graph (``torch.compile`` with ``capture_scalar_outputs=True``; targets may be the
    ``OpOverloadPacket`` or ``.default`` of ``torch.ops._c10d_functional.*``, torch 2.11's
    ``_c10d_functional_autograd.all_to_all_single`` whose wait hides in an ``autograd_function_apply``, and
    a user ``torch.autograd.Function`` whose forward is one all-to-all (Megatron's and DeepSpeed's
    ``_AllToAll``: ``fx_nodes.function_all_to_all``), which stands for its all-to-all; an in-place
    ``dist.all_to_all_single(out, ...)`` of the counts is ``out.copy_(wait(all_to_all_single(...)))``).
    Never mutates it (its shape env may gain a guard, below).
    ``find_moe_regions`` returns, in program order of their dispatch, one ``MoERegion`` per dispatch/combine
    pair it understands, and one ``RefusedRegion`` (with a reason, also logged at debug level as
    ``"match: skipped ..."``) per token all-to-all it does not. Matching uses dataflow, op targets, dtypes and
    shapes only (never node order or names, never data), so every rank decides the same. Symbolic sizes
    (dynamic shapes: T, K) are compared with ``fx_nodes.same_size``: equal statically, or, for two backed
    sizes equal at this call (x's T and the ids' T as separate symbols), under a guard that the compiled graph
    keeps; E_l must be a constant.
    Guarantees for a region: its dataflow is the pattern above, so the block computes
    ``y[t] = sum_k topk_scores[t, k] * F_{ids[t, k]}(x[t])`` (``scores_applied="before"``: ``y[t] = sum_k
    F_{ids[t, k]}(topk_scores[t, k] * x[t])``) with expert e on rank e // E_l; ``expert_fn`` is
    a standalone copy of F whose only inputs are the receive rows, the counts received from the exchange,
    split SymInts and expert weights (bound by ``ExpertFnBinding``); ``nodes`` is exactly what dies once
    ``output``'s uses go to a ring (the counts exchange and its host syncs included, ``x``/``topk_ids``/
    ``topk_scores``/``weights`` excluded), and regions share no such node.
    Refuses (legal but unsupported): an all-to-all whose partner is not in this graph (graph break), scores
    applied both before and after the experts, F reading anything else (tokens, router, another collective), region values
    used outside the region, outputs whose shape or dtype differs from ``x``, non-contiguous expert placement.

Pseudo-code:
    # Step 1: classify collectives: token all-to-alls (floating point), integer counts exchanges.
    # Step 2: pair each token all-to-all (combine) with the closest token all-to-all upstream of its
    #         input (dispatch) whose splits it swaps; the rest are refused.
    # Step 3: dispatch side: send = x[order // K] (or x[order // K] * topk_scores.flatten()[order][:, None])
    #         with order = argsort(topk_ids.flatten()).
    # Step 4: combine side: y = scatter_add(zeros[T, H], order // K, back * topk_scores.flatten()[order]) (or
    #         back alone when the dispatch scaled the rows).
    # Step 5: split SymInts of the receive (per source, or per (source, expert)) and the counts exchange
    #         they come from; E_l.
    # Step 6: F = backward slice from the combine input down to the receive, the counts, the split SymInts
    #         and the expert weights, plus the mutators and asserts that act on it; copy it into a graph.
    # Step 7: the nodes that die once the output is replaced; refuse if the a2as would survive.

Legend: T local tokens, K top-k, H hidden, N ranks in the EP group, E_l experts per rank, S segment rows.
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass
from typing import cast

import torch
import torch.fx as fx

from relay_compile.passes.capacity_match import find_capacity_regions
from relay_compile.passes.expert_fn import copy_expert_fn, slice_expert_fn
from relay_compile.passes.fx_nodes import (
    all_to_all_args,
    ancestors,
    arg,
    block_shape,
    closest,
    dtype_of,
    function_all_to_all,
    is_all_to_all,
    is_call,
    is_method_call,
    is_mutator,
    report_size,
    same_shape,
    same_size,
    shape_of,
    size_value,
    static_int,
    subgraph_all_to_alls,
    upstream_collectives,
    wait_end,
)
from relay_compile.passes.liveness import assert_cones, dead_after_replacing
from relay_compile.passes.pairing import pair_token_all_to_alls
from relay_compile.passes.refusals import Refusal, RefusedRegion
from relay_compile.passes.region import ExpertsInput, Region
from relay_compile.passes.roles import (
    CAST_METHODS,
    as_scatter,
    flat_index_of_item,
    forward_through,
    is_zeros,
    peel,
    router_num_experts,
    row_gather,
    score_column,
    sort_order,
    split_leaves,
    token_index,
    unpermuted_sum,
    unflatten,
)
from relay_compile.runtime.block_shape import BlockShape
from relay_compile.runtime.region_fn import ExpertFnBinding, SplitKind
from relay_compile.runtime.specs import ScoresApplied
from relay_compile.runtime.transport import RingGroup

log = logging.getLogger(__name__)

__all__ = ["MoERegion", "find_moe_regions"]


def _flat_index(item: fx.Node) -> int:
    """The element ``k`` a ``t[k].item()`` reads (callers checked it is one)."""
    flat = flat_index_of_item(item)
    assert flat is not None, f"match: {item.name} is not t[k].item()"
    return flat[1]


# ----------------------------------------------------------------------------------------------------------
# Records
# ----------------------------------------------------------------------------------------------------------


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
    topk_scores: fx.Node  # (T, K), applied after the combine (or to the dispatched rows: scores_applied)
    order: fx.Node  # argsort of the flat ids
    output: fx.Node  # y (T, H): what the ring replaces
    weights: tuple[fx.Node, ...]  # the local expert weights F reads (DTensor parameters: after to_local)
    expert_fn: fx.GraphModule  # F: recv rows, counts, split SymInts, weights -> out (R, H)
    binding: ExpertFnBinding
    experts_per_rank: int
    top_k: int  # K (its hint when symbolic: report only, the ring reads K from topk_ids)
    group_name: str
    group_size: int
    nodes: frozenset[fx.Node]  # what dies once output's uses go elsewhere
    # A buffer the in-place combine scatter wrote, read after it: those reads take the ring's result too.
    output_aliases: tuple[fx.Node, ...] = ()
    # Where the scores multiply: F's output rows in the combine, or the dispatched rows before F.
    scores_applied: ScoresApplied = "after"
    # F reads a hop's rows with their counts and splits: it can run per hop as it is.
    experts_input: ExpertsInput = "rows"

    def idiom(self) -> str:
        exchange = "all_to_all" if is_all_to_all(self.counts_exchange) else "all_gather"
        combine = "unpermute, then sum over K" if self.output.target in ("sum", torch.sum) else "scatter-add"
        dispatch = "x[order // K] * scores" if self.scores_applied == "before" else "x[order // K]"
        return f"top-k: dispatch {dispatch}, counts by {exchange}, combine {combine}"

    def inputs(self) -> dict[str, fx.Node]:
        return {"topk_ids": self.topk_ids, "topk_scores": self.topk_scores}

    def first_collective(self) -> fx.Node:
        return self.counts_exchange

    def insert_pairs(self) -> tuple[fx.Node, fx.Node]:
        return self.topk_ids, self.topk_scores

    def block_shape(self) -> BlockShape:
        """Sizes of the block on this rank, from the nodes' fake values: a symbolic size's hint (0 if unbacked)."""
        return block_shape(
            self.x, self.weights, top_k=self.top_k,
            experts_per_rank=self.experts_per_rank, group_size=self.group_size,
            matrices_per_expert=len(self.weights),  # 2-3 weights, one (F, H) matrix per expert each
        )

    def describe(self) -> str:
        return (
            f"MoE region dispatch={self.dispatch.name} combine={self.combine.name} output={self.output.name} "
            f"(group {self.group_name!r} of {self.group_size}, E_l={self.experts_per_rank}, K={self.top_k}, "
            f"{len(self.weights)} weights, F: {len(self.expert_fn.graph.nodes)} nodes, scores {self.scores_applied})"
        )


# ----------------------------------------------------------------------------------------------------------
# Steps 3-7: one region
# ----------------------------------------------------------------------------------------------------------


def _scaled_gather(send: fx.Node) -> tuple[tuple[fx.Node, fx.Node], fx.Node] | None:
    """``((x, idx), scores)`` of ``x[idx] * scores.flatten()[order][:, None]`` with ``idx = order // K`` (casts
    around the product or its factors allowed: torchtitan's ``(rows.float() * s).to(x.dtype)``), else None."""
    product = peel(send, CAST_METHODS)
    if not (is_call(product, operator.mul, torch.mul) or is_method_call(product, "mul")):
        return None
    assert isinstance(product, fx.Node)
    for factor, other in ((product.args[0], product.args[1]), (product.args[1], product.args[0])):
        rows = peel(factor, CAST_METHODS)
        gather = row_gather(rows) if isinstance(rows, fx.Node) else None
        token = token_index(gather[1]) if gather is not None else None
        scores = score_column(other, token[0]) if token is not None else None
        if gather is not None and scores is not None:
            return gather, scores
    return None


def _match_dispatch_side(dispatch: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, object, fx.Node | None]:
    """Step 3: ``(x, topk_ids, order, K, scores)`` from ``send = x[order // K]``; ``scores``: the ``(T, K)``
    scores when the send is ``x[order // K] * scores.flatten()[order][:, None]`` (scores before the experts)."""
    send = peel(all_to_all_args(dispatch).input, CAST_METHODS)  # .contiguous() before an in-place all-to-all
    if not isinstance(send, fx.Node):
        raise Refusal(dispatch, f"the dispatch input {send!r} is not a row gather x[order // K] of the tokens")
    gather, scores_before = row_gather(send), None
    if gather is None:
        scaled = _scaled_gather(send)
        if scaled is None:
            raise Refusal(dispatch, f"the dispatch input {send.name} is not a row gather x[order // K] of the "
                                    "tokens, nor one times topk_scores.flatten()[order]")
        gather, scores_before = scaled
    x, idx = gather
    token = token_index(idx)
    if token is None:
        raise Refusal(dispatch, f"the send gather {send.name} indexes by {idx.name}, not order // K")
    order, top_k = token  # K: an int, or a node of a SymInt under dynamic shapes
    flat_ids = sort_order(order)
    topk_ids = unflatten(flat_ids) if flat_ids is not None else None
    if topk_ids is None:
        raise Refusal(dispatch, f"{order.name} is not argsort / sort of the flattened top-k expert ids")
    ids_shape, x_shape = shape_of(topk_ids), shape_of(x)
    if ids_shape is None or len(ids_shape) != 2 or not same_size(ids_shape[1], top_k):
        raise Refusal(dispatch, f"top-k ids {topk_ids.name} have shape {ids_shape}, not (T, K={size_value(top_k)})")
    if x_shape is None or len(x_shape) != 2 or not same_size(x_shape[0], ids_shape[0]):
        raise Refusal(dispatch, f"tokens {x.name} have shape {x_shape}, not (T={ids_shape[0]}, H)")
    ids_dtype, x_dtype = dtype_of(topk_ids), dtype_of(x)
    if ids_dtype is None or ids_dtype.is_floating_point or ids_dtype == torch.bool:
        raise Refusal(dispatch, f"top-k ids {topk_ids.name} have dtype {ids_dtype}, not an integer type")
    # Step 1 kept floating-point all-to-alls only, and the send has x's dtype (x's shape was checked above).
    assert x_dtype is not None and x_dtype.is_floating_point, f"match: tokens {x.name} have dtype {x_dtype}"
    return x, topk_ids, order, top_k, scores_before


def _buffer_aliases(combine: fx.Node, scatter: fx.Node, buffer: fx.Node) -> tuple[fx.Node, ...]:
    """``(buffer,)`` when an in-place scatter's buffer is read after it (``y = zeros_like(x); y.index_add_(...);
    return y``): those reads then take the ring's result. Refuses reads before the scatter and other writes."""
    readers = [u for u in buffer.users if u is not scatter]
    if not readers:
        return ()
    position = {n: i for i, n in enumerate(combine.graph.nodes)}
    early = [u.name for u in readers if position[u] < position[scatter] or is_mutator(u)]
    if early:
        raise Refusal(combine, f"{scatter.name} scatters in place into {buffer.name}, which {', '.join(early)} also "
                               "read(s) before the scatter or write(s) into; only reads after it can take the ring's "
                               "result")
    return (buffer,)


def _combine_scatter(
    combine: fx.Node, src: fx.Node, order: fx.Node, top_k: object
) -> tuple[fx.Node, tuple[fx.Node, ...]] | None:
    """``(scatter, aliases)``: the ``scatter_add(zeros, order // K, src)`` of ``src`` (through casts), or None;
    ``aliases``: the buffer of an in-place scatter that is read after it."""
    for value in forward_through(src, CAST_METHODS):
        for user in value.users:
            scatter = as_scatter(user)
            if scatter is None or scatter.src is not value:
                continue
            token = token_index(scatter.index)
            if token is None or token[0] is not order or not same_size(token[1], top_k):
                raise Refusal(combine, f"the combine scatter {user.name} does not index by order // K")
            if not is_zeros(scatter.target):
                raise Refusal(combine, f"the combine scatter {user.name} adds into "
                                       f"{getattr(scatter.target, 'name', scatter.target)}, not fresh zeros")
            aliases: tuple[fx.Node, ...] = ()
            if scatter.in_place and isinstance(scatter.target, fx.Node):
                aliases = _buffer_aliases(combine, user, scatter.target)
            return user, aliases
    return None


def _match_combine_side(
    combine: fx.Node, back: fx.Node, order: fx.Node, top_k: object, scores_before: fx.Node | None
) -> tuple[fx.Node, fx.Node, tuple[fx.Node, ...]]:
    """Step 4: ``(output, topk_scores, aliases)`` from ``scatter_add(zeros, order // K, back *
    scores.flatten()[order])`` or its unpermute-and-sum form (``roles.unpermuted_sum``), or ``scatter_add(zeros,
    order // K, back)`` when the dispatch applied ``scores_before``; ``aliases``: the buffer of an in-place scatter
    that is read after it."""
    if scores_before is not None:
        found = _combine_scatter(combine, back, order, top_k)
        if found is None:
            raise Refusal(combine, f"the dispatch applies the scores before the experts, but no scatter_add(zeros, "
                                   f"order // K, {back.name}) of the unweighted rows follows the combine (scores "
                                   "applied both before and after the experts, or another reduction)")
        return found[0], scores_before, found[1]
    for weighted in forward_through(back, CAST_METHODS):
        for mul in weighted.users:
            if not (is_call(mul, operator.mul, torch.mul) or is_method_call(mul, "mul")):
                continue
            other = mul.args[1] if mul.args[0] is weighted else mul.args[0]
            scores = score_column(other, order)
            found = _combine_scatter(combine, mul, order, top_k) if scores is not None else None
            if found is not None:
                assert scores is not None
                return found[0], scores, found[1]
    unpermuted = unpermuted_sum(back, order, top_k)
    if unpermuted is not None:
        return unpermuted[0], unpermuted[1], ()
    raise Refusal(combine, f"no scatter_add(zeros, order // K, {back.name} * topk_scores.flatten()[order]) "
                           "after the combine, nor buf[order] = back; (buf.view(T, K, H) * topk_scores.unsqueeze(-1))"
                           ".sum(1) (scores applied elsewhere, or another reduction)")


def _gathered_local_counts(exchange: fx.Node, group_name: str, group_size: int, e_l: int) -> fx.Node | None:
    """This rank's columns ``(N, E_l)`` of an all-gathered ``(N, E)`` counts tensor, where the graph slices them
    with constant bounds (megatron-core's ``num_global_tokens_per_local_expert``): what the ``ExpertFn`` contract
    gives F as its counts, so F may read them (``SequentialMLP``'s ``tokens_per_expert``). None where the graph
    takes no such slice: F then may not read the gathered counts (``expert_fn.slice_expert_fn`` refuses)."""
    rank = RingGroup.resolve(group_name).rank
    found, todo = [], [wait_end(exchange)]
    while todo:
        for u in todo.pop().users:
            if is_method_call(u, "view", "reshape") or is_call(u, torch.reshape):
                todo.append(u)  # the gathered counts as (N, E)
            elif (_column_bounds(u) == (rank * e_l, (rank + 1) * e_l)
                  and same_shape(shape_of(u), (group_size, e_l))):
                found.append(u)
    return found[0] if len(found) == 1 else None


def _column_bounds(n: fx.Node) -> tuple[int, int] | None:
    """``(lo, hi)`` of ``t[:, lo:hi]`` or ``t.narrow(1, lo, hi - lo)`` with constant bounds, else None."""
    if is_call(n, operator.getitem) and isinstance(n.args[1], tuple) and len(n.args[1]) == 2:
        rows, cols = n.args[1]
        if rows == slice(None) and isinstance(cols, slice) and cols.step in (None, 1):
            lo, hi = cols.start or 0, cols.stop
            return (lo, hi) if isinstance(lo, int) and isinstance(hi, int) else None
    if is_method_call(n, "narrow") and len(n.args) == 4 and n.args[1] in (1, -1):
        lo, length = n.args[2], n.args[3]
        return (lo, lo + length) if isinstance(lo, int) and isinstance(length, int) else None
    return None


def _match_splits(
    dispatch: fx.Node, group_size: int
) -> tuple[SplitKind, list[list[fx.Node]], fx.Node, int]:
    """Step 5: ``(kind, leaves[s][e], counts exchange, E_l)`` of the dispatch's receive splits."""
    _, out_splits, in_splits, _ = all_to_all_args(dispatch)
    if len(out_splits) != group_size or len(in_splits) != group_size:
        raise Refusal(dispatch, f"split lists of {dispatch.name} have lengths {len(out_splits)}, {len(in_splits)}")
    leaves = []
    for s, split in enumerate(out_splits):
        found = split_leaves(split)
        if not found:
            raise Refusal(dispatch, f"receive split {s} of {dispatch.name} ({split!r}) is not a host read (.item()) "
                                    "of the exchanged counts in this graph (compile with torch._dynamo.config."
                                    "capture_scalar_outputs=True so .tolist() of the splits stays in the graph)")
        leaves.append(found)
    widths = {len(x) for x in leaves}
    if len(widths) != 1:
        raise Refusal(dispatch, f"receive splits of {dispatch.name} add up different numbers of SymInts {widths}")
    width = widths.pop()
    # The counts exchange: the integer collective the split SymInts come from.
    exchanges = closest({
        n for n in upstream_collectives(leaf for row in leaves for leaf in row)
        if not (dtype_of(n) or torch.float32).is_floating_point
    })
    if len(exchanges) != 1:
        raise Refusal(dispatch, f"receive splits of {dispatch.name} come from {len(exchanges)} integer collectives, "
                                "not one counts exchange")
    exchange = exchanges.pop()
    # E_l is baked into the ring (its spec): the counts' size must be a constant, not a symbol.
    dims = [static_int(d) for d in shape_of(exchange) or ()]
    if None in dims:
        raise Refusal(dispatch, f"counts exchange {exchange.name} has symbolic shape {shape_of(exchange)}: the "
                                "ring needs the number of experts as a constant (torch._dynamo.mark_static on "
                                "the tensor it comes from)")
    numel = math.prod(cast(list[int], dims))
    if is_all_to_all(exchange):  # received counts (N, E_l), row s from source s
        e_l, rem = divmod(numel, group_size)
        for splits in all_to_all_args(exchange)[1:3]:
            # Equal static splits: rank r owns experts [r * E_l, (r + 1) * E_l), as the ring assumes. (Under
            # dynamic shapes Dynamo passes them as nodes of constant SymInts.)
            if splits and (len({static_int(s) for s in splits}) != 1 or static_int(splits[0]) is None):
                raise Refusal(dispatch, f"counts exchange {exchange.name} has splits {splits}, not equal constants: "
                                        "experts are not placed contiguously (expert e on rank e // E_l)")
    else:  # all_gather of every rank's counts per global expert: (N, E)
        e_l, rem = divmod(numel, group_size * group_size)
    if rem or e_l < 1:
        raise Refusal(dispatch, f"counts exchange {exchange.name} holds {numel} counts, not E_l per rank pair")
    kind: SplitKind
    if width == 1:
        kind = "source"
    elif width == e_l:
        kind = "source_expert"
        # The (s, e) SymInt is element s * E_l + e of a flattened (N, E_l) tensor when it reads one.
        for s, row in enumerate(leaves):
            flats = [flat_index_of_item(leaf) for leaf in row]
            if all(f is not None and same_shape(shape_of(f[0]), (group_size * e_l,)) for f in flats):
                # A sum lists its terms in any order (Dynamo folds `sum(...)` into torch.sym_sum): bind each
                # SymInt by the element it reads, then check the row holds exactly source s's elements.
                row.sort(key=lambda leaf: _flat_index(leaf))
            for e, leaf in enumerate(row):
                flat = flat_index_of_item(leaf)
                shape = shape_of(flat[0]) if flat is not None else None
                if flat is not None and same_shape(shape, (group_size * e_l,)) and flat[1] != s * e_l + e:
                    raise Refusal(dispatch, f"receive split SymInt {leaf.name} reads counts element {flat[1]}, "
                                            f"not (source {s}, expert {e})")
    else:
        raise Refusal(dispatch, f"receive splits of {dispatch.name} add up {width} SymInts each; expected 1 (per "
                                f"source) or E_l={e_l} (per source and expert)")
    return kind, leaves, exchange, e_l


def _match_region(gm: fx.GraphModule, dispatch: fx.Node, combine: fx.Node, weak: set[fx.Node]) -> MoERegion:
    _, d_out, _, group_name = all_to_all_args(dispatch)
    if not isinstance(group_name, str) or all_to_all_args(combine)[3] != group_name:
        raise Refusal(dispatch, f"group names of {dispatch.name} and {combine.name} are not one constant string")
    group_size = len(d_out)
    recv, back = wait_end(dispatch), wait_end(combine)

    # Step 3: dispatch side.
    x, topk_ids, order, top_k, scores_before = _match_dispatch_side(dispatch)

    # Step 4: combine side.
    output, topk_scores, aliases = _match_combine_side(combine, back, order, top_k, scores_before)
    if not same_shape(shape_of(topk_scores), shape_of(topk_ids)) or not (
        dtype_of(topk_scores) or torch.int64
    ).is_floating_point:
        raise Refusal(combine, f"top-k scores {topk_scores.name} are not floating point of the ids' shape")
    if not same_shape(shape_of(output), shape_of(x)) or dtype_of(output) != dtype_of(x):
        raise Refusal(combine, f"the block output {output.name} is {dtype_of(output)}{list(shape_of(output) or [])}, "
                               f"the tokens {dtype_of(x)}{list(shape_of(x) or [])}; the ring returns the tokens' type")

    # Step 5: splits, counts exchange, E_l.
    kind, leaves, exchange, e_l = _match_splits(dispatch, group_size)
    exchange_group = arg(exchange, 3, "group_name") if is_all_to_all(exchange) else arg(exchange, 2, "group_name")
    if exchange_group != group_name:
        raise Refusal(dispatch, f"counts exchange {exchange.name} runs on group {exchange_group!r}, the tokens on "
                                f"{group_name!r}")
    if is_all_to_all(exchange):
        counts: fx.Node | None = wait_end(exchange)
    else:
        counts = _gathered_local_counts(exchange, group_name, group_size, e_l)
    num_experts = router_num_experts(topk_ids)
    if num_experts is not None and not same_size(num_experts, e_l * group_size):
        raise Refusal(dispatch, f"the router picks among {num_experts} experts but the counts exchange "
                                f"{exchange.name} implies {e_l} per rank on {group_size} ranks")

    # Step 6: F.
    inputs: dict[fx.Node, str] = {recv: "rows"}
    if counts is not None:
        inputs[counts] = "counts"
    for row in leaves:
        for leaf in row:
            inputs[leaf] = "split"
    forbidden = ancestors([all_to_all_args(dispatch)[0], topk_ids, topk_scores])
    body, used, weights = slice_expert_fn(dispatch, combine, inputs, forbidden)
    # The dispatch is upstream of the combine's input (step 2), and F's slice refuses any collective other than
    # the receive it meets on the way (another wait, the all-to-all itself): so F reads the receive.
    assert recv in used, f"match: F of {dispatch.name} does not read the token receive {recv.name}"
    expert_fn, binding = copy_expert_fn(
        gm, body, all_to_all_args(combine)[0], recv, counts, leaves, weights, used, kind
    )

    # Step 7: what dies.
    dead = dead_after_replacing(output, {x, topk_ids, topk_scores, *weights}, weak, aliases)
    for role, n in (("dispatch", dispatch), ("combine", combine), ("receive", recv), ("combine result", back)):
        if n not in dead:
            users = ", ".join(u.name for u in n.users)
            raise Refusal(dispatch, f"the {role} {n.name} stays alive after the rewrite (a value of the region "
                                    f"is used outside it; users: {users})")
    for n in body:
        if n not in dead:
            raise Refusal(dispatch, f"F's {n.name} is used outside the region")
    return MoERegion(
        dispatch=dispatch, combine=combine, recv=recv, back=back, counts_exchange=exchange, x=x,
        topk_ids=topk_ids, topk_scores=topk_scores, order=order, output=output, weights=tuple(weights),
        expert_fn=expert_fn, binding=binding, experts_per_rank=e_l, top_k=report_size(size_value(top_k)),
        group_name=group_name, group_size=group_size, nodes=frozenset(dead), output_aliases=aliases,
        scores_applied="after" if scores_before is None else "before",
    )


# ----------------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------------


def _hidden_all_to_alls(n: fx.Node) -> str | None:
    """Why all-to-alls at ``n`` are out of the matcher's reach (a user autograd.Function it does not understand,
    or the subgraph of another higher-order op), else None."""
    why = function_all_to_all(n)
    return why if isinstance(why, str) else subgraph_all_to_alls(n)


def find_moe_regions(gm: fx.GraphModule) -> tuple[list[Region], list[RefusedRegion]]:
    """All a2a EP MoE regions of ``gm`` in program order, and the token all-to-alls left alone (with why).

    Top-k regions (this module) and capacity-based ones (``capacity_match``), both ``region.Region``. Pure:
    reads the graph and its fake values only, never mutates ``gm`` and runs nothing (``expert_fn`` of each
    region is a copy).
    """
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    # Step 1: token all-to-alls by the dtype of what they move (the counts exchange moves integers); a user
    # autograd.Function with an all-to-all in its forward that is not understood is refused here.
    token_a2as = [n for n in gm.graph.nodes
                  if is_all_to_all(n) and (dtype_of(wait_end(n)) or torch.int64).is_floating_point]
    hidden = [RefusedRegion(n, why) for n in gm.graph.nodes if (why := _hidden_all_to_alls(n)) is not None]
    weak = assert_cones(gm.graph)
    # Capacity-based dispatch (einsum into (E, C, H) buffers, equal splits) claims its all-to-alls first.
    regions: list[Region]
    capacity, refused_capacity, token_a2as = find_capacity_regions(gm, token_a2as, weak)
    regions = list(capacity)
    # Step 2: pairs.
    pairs, refused = pair_token_all_to_alls(token_a2as)
    refused += hidden + refused_capacity
    for dispatch, combine in pairs:
        try:
            regions.append(_match_region(gm, dispatch, combine, weak))
        except Refusal as r:
            refused.append(r.record())
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
    for refusal in refused:
        log.debug("match: skipped %s: %s", refusal.node.name, refusal.reason)
    for region in regions:
        log.debug("match: found %s", region.describe())
    refused.sort(key=lambda refusal: position[refusal.node])
    return regions, refused
"""expert_fn: F, the block between a region's two all-to-alls, cut out into a graph of its own and run per hop.

    slice_expert_fn   the nodes of F: the backward slice of the combine's input down to F's inputs
    copy_expert_fn    F copied into a standalone ``GraphModule``, with its ``ExpertFnBinding``

The copy runs per hop as ``runtime.region_fn.RegionExpertFn`` (the ring's ``ExpertFn``).

F's inputs are the token receive, the counts exchange's received tensor, the receive's split SymInts and the
expert weights (placeholders or ``p.to_local()`` of DTensor parameters); ``ExpertFnBinding`` says which
placeholder of the copy each of them became.

Legend: R received rows, S segment rows, H hidden, N ranks, E_l experts per rank.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.fx as fx

from relay_compile.passes.fx_nodes import (
    all_to_all_args,
    describe,
    dtype_of,
    flat_nodes,
    is_assert,
    is_collective,
    is_mutator,
    shape_of,
)
from relay_compile.passes.refusals import Refusal
from relay_compile.passes.roles import is_symbolic_arith, is_weight_source
from relay_compile.runtime.region_fn import ExpertFnBinding, SplitKind


def slice_expert_fn(
    dispatch: fx.Node, combine: fx.Node, inputs: dict[fx.Node, str], forbidden: set[fx.Node]
) -> tuple[list[fx.Node], set[fx.Node], list[fx.Node]]:
    """``(F's nodes in program order, inputs F reads, weights)``.

    F is the backward slice of the combine input that stops at ``inputs`` (receive, counts, split SymInts)
    and at weight sources, plus in-place writes into its values that have no users (torchtitan's ``setitem``
    unpermute), plus the asserts on its SymInts whose comparisons read only F and its inputs.
    """
    body: set[fx.Node] = set()
    used: set[fx.Node] = set()
    weights: set[fx.Node] = set()
    stack = flat_nodes([all_to_all_args(combine)[0]])
    while stack:
        n = stack.pop()
        if n in body or n in used or n in weights:
            continue
        if n in inputs:
            used.add(n)
            continue
        if is_weight_source(n):
            if n in forbidden or (n.op == "call_method" and n.args[0] in forbidden):
                raise Refusal(dispatch, f"F reads {describe(n)}, which also feeds the dispatch (tokens or "
                                        "routing); only expert weights may enter F from outside")
            weights.add(n)
            continue
        if n.op == "placeholder":
            raise Refusal(dispatch, f"F reads {describe(n)}, which is neither a tensor nor a split size of the "
                                    "receive")
        if is_collective(n):
            integer = not (dtype_of(n) or torch.float32).is_floating_point
            hint = (": experts may read all-gathered counts only as this rank's columns, t.view(N, E)[:, r * E_l:"
                    "(r + 1) * E_l] with constant bounds" if integer else "")
            raise Refusal(dispatch, f"F reads {describe(n)}, a collective that is neither the token receive "
                                    f"nor the counts exchange{hint}")
        body.add(n)
        stack.extend(n.all_input_nodes)
        for u in n.users:
            if not u.users and is_mutator(u) and u.args[0] is n:
                stack.append(u)
    # Writes into F's values from outside F would change what F computes.
    for n in body:
        for u in n.users:
            if u not in body and is_mutator(u) and u.args[0] is n:
                raise Refusal(dispatch, f"{describe(u)} writes into F's {n.name} from outside the region")
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
            if is_assert(u) and not u.users:
                asserts.add(u)
            elif is_symbolic_arith(u):
                todo.append(u)
    for a in asserts:
        cone: set[fx.Node] = set()
        ok, todo = True, list(a.all_input_nodes)
        while todo and ok:
            m = todo.pop()
            if m not in known and m not in cone:
                ok = is_symbolic_arith(m)
                cone.add(m)
                todo.extend(m.all_input_nodes)
        if ok:
            body |= cone | {a}
    order = {n: i for i, n in enumerate(combine.graph.nodes)}
    return sorted(body, key=order.__getitem__), used, sorted(weights, key=order.__getitem__)


def copy_expert_fn(
    gm: fx.GraphModule,
    body: list[fx.Node],
    output: object,
    rows: fx.Node,
    counts: fx.Node | None,
    split_leaves: list[list[fx.Node]],
    weights: list[fx.Node],
    used: set[fx.Node],
    kind: SplitKind,
) -> tuple[fx.GraphModule, ExpertFnBinding]:
    """Copy F into a fresh graph; placeholders: rows, counts, used splits, weights."""
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
    graph.output(fx.node.map_arg(cast(fx.node.Argument, output), lambda a: env[a]))
    graph.lint()
    fn = fx.GraphModule(gm, graph, class_name="ExpertFn")
    counts_shape = shape_of(counts) if counts_pos is not None else None
    binding = ExpertFnBinding(
        rows=rows_pos,
        counts=counts_pos,
        counts_shape=tuple(int(d) for d in counts_shape) if counts_shape is not None else None,
        split_kind=kind,
        splits=tuple(splits),
        weights=weight_pos,
    )
    return fn, binding

"""expert_fn: F, the block between a region's two all-to-alls, cut out into a graph of its own and run per hop.

    slice_expert_fn   the nodes of F: the backward slice of the combine's input down to F's inputs
    copy_expert_fn    F copied into a standalone ``GraphModule``, with its ``ExpertFnBinding``
    RegionExpertFn    the ring's ``ExpertFn`` (``relay_compile.experts``) over that copy

F's inputs are the token receive, the counts exchange's received tensor, the receive's split SymInts and the
expert weights (placeholders or ``p.to_local()`` of DTensor parameters); ``ExpertFnBinding`` says which
placeholder of the copy each of them became, and ``RegionExpertFn`` feeds them from a hop's segment.

Legend: R received rows, S segment rows, H hidden, N ranks, E_l experts per rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, cast

import torch.fx as fx
from torch import Tensor

from relay_compile.passes.fx_nodes import (
    all_to_all_args,
    describe,
    flat_nodes,
    is_assert,
    is_collective,
    is_mutator,
    shape_of,
)
from relay_compile.passes.refusals import Refusal
from relay_compile.passes.roles import is_symbolic_arith, is_weight_source

SplitKind = Literal["source", "source_expert"]


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
    split_kind: SplitKind
    splits: tuple[tuple[int | None, ...], ...]
    weights: tuple[int, ...]


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
            raise Refusal(dispatch, f"F reads {describe(n)}, a collective that is neither the token receive "
                                    "nor the counts exchange")
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


class RegionExpertFn:
    """The ring's ``ExpertFn`` over a region's F: ``(x_SH, counts_NL, splits_N, weights) -> out_SH``.

    Maps the ring's inputs onto F's placeholders (``ExpertFnBinding``) and runs F eagerly. Split SymInts get
    plain ints: per source from ``splits_N``, per (source, expert) from ``counts_NL`` read on the host.
    Two adapters are equal when their F has the same code and binding, so re-registering the same region
    (a recompile, or identical layers) reuses one spec.
    """

    def __init__(self, fn: fx.GraphModule, binding: ExpertFnBinding) -> None:
        self.fn = fn
        self.binding = binding
        self.num_inputs = len(fn.graph.find_nodes(op="placeholder"))
        # F with constants of its own (get_attr) is only equal to itself.
        constants = () if not fn.graph.find_nodes(op="get_attr") else (id(fn),)
        self._identity = (fn.code, binding, constants)
        self.__qualname__ = f"RegionExpertFn[{self.digest()}]"

    def digest(self) -> str:
        return hashlib.sha256(repr(self._identity).encode()).hexdigest()[:12]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RegionExpertFn) and other._identity == self._identity

    def __hash__(self) -> int:
        return hash(self._identity)

    def split_values(self, counts_NL: Tensor, splits_N: list[int]) -> list[int]:
        """The ints F's split placeholders get, in binding order (``binding.splits`` row by row, used ones)."""
        b = self.binding
        if b.split_kind == "source":
            return [int(splits_N[s]) for s, (pos,) in enumerate(b.splits) if pos is not None]
        counts_host = counts_NL.tolist()  # NOTE: device-to-host sync (F splits rows per (source, expert))
        return [counts_host[s][e] for s, row in enumerate(b.splits) for e, pos in enumerate(row) if pos is not None]

    def arguments(
        self, x_SH: Tensor, counts_NL: Tensor, split_values: Sequence[object], weights: Sequence[Tensor]
    ) -> list[object]:
        """F's arguments, in placeholder order, from the ring's inputs and ``split_values`` (``split_values``
        order; ints, or SymInts when a compiler traces this)."""
        b = self.binding
        args: list[object] = [None] * self.num_inputs
        args[b.rows] = x_SH
        if b.counts is not None:
            assert b.counts_shape is not None
            args[b.counts] = counts_NL.reshape(b.counts_shape)
        positions = [pos for row in b.splits for pos in row if pos is not None]
        for pos, value in zip(positions, split_values, strict=True):
            args[pos] = value
        if len(weights) != len(b.weights):
            raise ValueError(f"rewrite: {self.__qualname__} takes {len(b.weights)} weights, got {len(weights)}")
        for pos, w in zip(b.weights, weights):
            args[pos] = w
        return args

    def __call__(self, x_SH: Tensor, counts_NL: Tensor, splits_N: list[int], weights: Sequence[Tensor]) -> Tensor:
        return self.fn(*self.arguments(x_SH, counts_NL, self.split_values(counts_NL, splits_N), weights))

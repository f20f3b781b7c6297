"""split_reads: an all-to-all whose split sizes a graph reads element by element runs as one op that reads them.

Dispatchers read their split sizes with ``splits.tolist()``; Dynamo traces that into one ``.item()`` per
element, an unbacked SymInt each, 2N per token all-to-all at EP=N, with the runtime asserts and symbolic sums
built on them. The compiled graph runs all of that on the host at every call: at EP=64 it made a kept region's
compiled all-to-all 1.15-1.30x a2a eager (docs/BENCHMARKS.md, "Kept regions"), and inductor spent minutes of
sympy on the 128 symbols. This pass gives each such all-to-all ``relaymoe::split_all_to_all``
(``runtime.split_all_to_all``), which takes the two tensors the lists were read from and reads them itself, so
its output has one unbacked row count, or none where the graph knows it (a combine returning a dispatch's rows).

Before (after ``host_reads``)::

    splits_host = splits.to('cpu', copy=True)
    getitem = splits_host[0];  getitem_1 = getitem[0];  item = getitem_1.item();  ...    # 2N reads
    getitem_9 = splits_host[1];  ...
    a2a = torch.ops._c10d_functional.all_to_all_single(x, [item_2, item_3], [item, item_1], '1')
    recv = torch.ops._c10d_functional.wait_tensor(a2a)
    rows = torch.sym_sum([item_2, item_3])
    back = torch.ops._c10d_functional.all_to_all_single(y, [item, item_1], [item_2, item_3], '1')

After::

    splits_host = splits.to('cpu', copy=True)
    recv = torch.ops.relaymoe.split_all_to_all.default(x, splits_host[0], splits_host[1], '1', None)
    rows = recv.size(0)
    back = torch.ops.relaymoe.split_all_to_all.default(y, splits_host[1], splits_host[0], '1', x.size(0))

Contract:

- Matched: an ``all_to_all_single`` (functional, differentiable where its input needs a gradient) whose output
  and input split lists are each every element, in order, of one row of a tensor (``t[i].tolist()``,
  ``t.tolist()``), on a named group.
- The reads go away with it, so every other use of them must go too. Those it understands: asserts about them
  alone (the collective checks its splits against its rows), symbolic values equal to the sum of one list
  (what reads them reads the rows of the tensor that list sizes instead), symbolic arithmetic used only by those,
  and higher-order ops whose subgraphs were handed them as shape symbols they compute nothing from. All-to-alls
  that share reads are taken together; where any read has another use (``torch.split(out, recv_splits)``, a loop
  over the counts, an assert relating them to other sizes), none of them is changed, and the reason is returned.
- Values are as traced: the op runs where the all-to-all ran and reads the same tensors, which nothing between
  the first read and the last all-to-all may write (else the family is left as traced).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import sympy
import torch
import torch.fx as fx

from relay_compile.passes.fx_nodes import (
    ALL_TO_ALL, ASSERTS, WAIT, all_to_all_args, is_call, is_item, node_value, qualname,
)
from relay_compile.passes.host_reads import index_step, read_path, written_between
from relay_compile.runtime.split_all_to_all import SPLIT_ALL_TO_ALL

log = logging.getLogger(__name__)

__all__ = ["SplitList", "SplitReads", "find_split_reads", "fold_split_reads"]


@dataclass(frozen=True)
class SplitList:
    """A split list read from one row of a tensor: ``base[prefix]``'s elements, in order, through ``reads``."""

    base: fx.Node
    prefix: tuple[int, ...]
    reads: tuple[fx.Node, ...]

    def __str__(self) -> str:
        return self.base.name + "".join(f"[{i}]" for i in self.prefix)

    def total(self) -> sympy.Expr:
        """The sum of the list, symbolically."""
        return sympy.Add(*(_expr(r) for r in self.reads))


@dataclass(frozen=True, kw_only=True)
class SplitReads:
    """An all-to-all whose two split lists are ``SplitList``s: ``recv`` its output splits, ``send`` its input's."""

    node: fx.Node
    group_name: str
    recv: SplitList
    send: SplitList


# Where a sum's readers read rows from: the tensor an all-to-all sends ("input"), or the one it returns ("output").
_Source = tuple[Literal["input", "output"], SplitReads]


@dataclass(frozen=True)
class _Sum:
    """A value equal to one split list's sum (``node``: a read or a symbolic value computed from the reads) that
    ``reader`` reads, where ``reader`` is not computed from the split sizes alone (tensor code, a relation to other
    sizes): ``reader`` reads the rows of the tensor that list sizes instead."""

    node: fx.Node
    total: sympy.Expr
    reader: fx.Node


@dataclass(eq=False)
class _Family:
    """All-to-alls that share reads, and what the rewrite does to the other users of those reads."""

    matches: list[SplitReads]
    asserts: list[fx.Node] = field(default_factory=list)  # about the split sizes alone: they go
    derived: list[fx.Node] = field(default_factory=list)  # symbolic values, erased once unused
    sums: list[_Sum] = field(default_factory=list)
    sources: dict[_Sum, _Source] = field(default_factory=dict)  # the rows each sum's reader reads instead
    dropped: set[fx.Node] = field(default_factory=set)  # asserts relating them to other sizes, with no rows to read
    lifted: list[fx.Node] = field(default_factory=list)  # higher-order ops handed them only as shape symbols

    def reads(self) -> set[fx.Node]:
        """Every read of the family's split lists."""
        return {r for m in self.matches for r in (*m.recv.reads, *m.send.reads)}


def _expr(n: fx.Node) -> sympy.Expr | None:
    """The symbolic integer ``n`` holds (a constant for a plain int), else None."""
    v = node_value(n)
    if isinstance(v, int) and not isinstance(v, bool):
        return sympy.Integer(v)
    if isinstance(v, torch.SymInt):
        return v.node.expr
    return None


def _is_symbolic(n: fx.Node) -> bool:
    """``n`` holds a host scalar (a SymInt, SymBool, SymFloat or a plain number), not a tensor."""
    return isinstance(node_value(n), (torch.SymInt, torch.SymBool, torch.SymFloat, int, bool, float))


def _symbols(nodes: Sequence[fx.Node]) -> set[sympy.Symbol]:
    """The free symbols of the symbolic values among ``nodes``."""
    out: set[sympy.Symbol] = set()
    for n in nodes:
        v = node_value(n)
        if isinstance(v, (torch.SymInt, torch.SymBool, torch.SymFloat)):
            out |= v.node.expr.free_symbols
    return out


def _split_list(sizes: list[object]) -> SplitList | None:
    """``sizes`` as every element of one tensor row read in order, else None."""
    reads = [s for s in sizes if isinstance(s, fx.Node) and is_item(s)]
    if not sizes or len(reads) != len(sizes) or any(_expr(r) is None for r in reads):
        return None
    paths = [read_path(r) for r in reads]  # (base, path, chain)
    base, first, _ = paths[0]
    prefix = first[:-1]
    if any(b is not base or p != (*prefix, j) for j, (b, p, _) in enumerate(paths)):
        return None
    row = node_value(base)
    if not isinstance(row, torch.Tensor) or row.dim() != len(prefix) + 1 or row.shape[len(prefix)] != len(reads):
        return None  # the reads are not the whole row: the op would read more than the list
    return SplitList(base, prefix, tuple(reads))


def _differentiable(n: fx.Node) -> bool:
    """Whether the traced all-to-all carries gradients (torch 2.11's base functional op does not; the op
    inserted here always does, so a non-differentiable one whose input needs a gradient is left alone)."""
    x = node_value(all_to_all_args(n).input)
    name = qualname(n.target)
    return not getattr(x, "requires_grad", False) or (
        name is not None and torch._C._dispatch_has_kernel_for_dispatch_key(name, "Autograd"))


def find_split_reads(gm: fx.GraphModule) -> tuple[list[SplitReads], list[str]]:
    """The all-to-alls of ``gm`` whose split lists are tensor rows read on the host; and, for all-to-alls with
    such lists left alone, why. Pure: nothing changes."""
    found, skipped = [], []
    for n in gm.graph.nodes:
        if not is_call(n, *ALL_TO_ALL):
            continue
        a = all_to_all_args(n)
        recv, send = _split_list(a.output_split_sizes), _split_list(a.input_split_sizes)
        if recv is None or send is None:
            if recv is not None or send is not None:
                skipped.append(f"{n.name}: one split list is not a whole tensor row read in order")
            continue
        if not isinstance(a.group_name, str):
            skipped.append(f"{n.name}: group {a.group_name!r} is not a group name")
        elif not _differentiable(n):
            skipped.append(f"{n.name}: {n.target} has no autograd in this torch, and its input needs a gradient")
        else:
            found.append(SplitReads(node=n, group_name=a.group_name, recv=recv, send=send))
    return found, skipped


def _families(matches: list[SplitReads]) -> list[_Family]:
    """Matches grouped by shared reads (a dispatch and its combine read the same lists)."""
    families: list[_Family] = []
    for m in matches:
        mine = {*m.recv.reads, *m.send.reads}
        joined = [f for f in families if f.reads() & mine]
        families = [f for f in families if all(f is not j for j in joined)]
        families.append(_Family([x for f in joined for x in f.matches] + [m]))
    return families


def _lifted_only(n: fx.Node) -> bool:
    """``n`` calls a higher-order op (``autograd.Function``, checkpoint) that Dynamo handed the symbols of a
    tensor operand's shape (transformers' ``_WaitTensor.apply(recv_tokens)`` takes the received rows' split
    sizes), and computes nothing from them: in every body, every placeholder that is not a tensor (a lifted
    symbol; the backward's, which carry no fake values) at most reaches the body's output (the forward hands
    them to the backward), and what the op returns to the graph are tensors."""
    owner = n.graph.owning_module
    if n.op != "call_function" or not isinstance(n.target, torch._ops.HigherOrderOperator) or owner is None:
        return False
    bodies = [getattr(owner, str(a.target), None) for a in n.all_input_nodes if a.op == "get_attr"]
    bodies = [b for b in bodies if isinstance(b, fx.GraphModule)]
    scalars = [p for b in bodies for p in b.graph.find_nodes(op="placeholder")
               if not isinstance(node_value(p), torch.Tensor)]
    return (any(isinstance(node_value(p), torch.SymInt) for p in scalars)
            and all(u.op == "output" for p in scalars for u in p.users)
            and all(isinstance(node_value(u), torch.Tensor) for u in n.users))


def _own(n: fx.Node, own: set[sympy.Symbol]) -> bool:
    """``n`` is computed from the split sizes alone: an assert or a symbolic value of their symbols only."""
    if is_call(n, *ASSERTS):
        return _symbols(n.all_input_nodes) <= own
    return _is_symbolic(n) and _symbols([n]) <= own


def _relation(n: fx.Node) -> list[fx.Node] | None:
    """``n`` and what it feeds where they only assert (a relation of the split sizes to other sizes), else None."""
    if is_call(n, *ASSERTS):
        return [n]
    if not _is_symbolic(n):
        return None
    chains = [_relation(u) for u in n.users]
    return None if any(c is None for c in chains) else [n, *(x for c in chains for x in c)]


def _classify(family: _Family) -> str | None:
    """Fill ``family``'s other users of its reads; the reason it cannot be rewritten, else None."""
    rewritten = {m.node for m in family.matches}
    reads = family.reads()
    totals = {m.recv.total() for m in family.matches} | {m.send.total() for m in family.matches}
    own = _symbols(list(reads))
    seen: set[fx.Node] = set()
    todo = list(reads)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n not in reads:
            if is_call(n, *ASSERTS):
                family.asserts.append(n)
                continue
            if _lifted_only(n):
                family.lifted.append(n)
                continue
            family.derived.append(n)
        for u in n.users:
            if u in rewritten:
                continue
            if _own(u, own) or _lifted_only(u):
                todo.append(u)
            elif _expr(n) in totals:
                family.sums.append(_Sum(n, _expr(n), u))
            elif (chain := _relation(u)) is not None:
                family.dropped.update(chain)
            else:
                name = qualname(u.target) or getattr(u.target, "__name__", u.target)
                return f"the split sizes are also read by {u.name} ({name})"
    return None


def _sources(total: sympy.Expr, matches: Sequence[SplitReads]) -> list[_Source]:
    """The tensors whose rows are ``total``: the input of an all-to-all whose send list sums to it, the output
    of one whose receive list does."""
    return ([("input", m) for m in matches if m.send.total() == total]
            + [("output", m) for m in matches if m.recv.total() == total])


def _choose_sources(order: dict[fx.Node, int], family: _Family) -> str | None:
    """For each sum, the rows its reader reads instead: of a tensor defined before the reader (a dispatch's input,
    an all-to-all's output), the earliest; where there is none, an assert's relation goes, anything else is the
    reason the family stays as traced."""
    def defined_at(source: _Source) -> int:
        kind, m = source
        return order[all_to_all_args(m.node).input if kind == "input" else m.node]

    for t in list(family.sums):
        before = [s for s in _sources(t.total, family.matches) if defined_at(s) < order[t.reader]]
        if before:
            family.sources[t] = min(before, key=defined_at)
        elif (chain := _relation(t.reader)) is not None:
            family.sums.remove(t)
            family.dropped.update(chain)
        else:
            return f"{t.reader.name} reads {t.node.name} before the tensor whose rows it counts is computed"
    return None


def _base_written(gm: fx.GraphModule, order: dict[fx.Node, int], family: _Family) -> str | None:
    """The reason where something between a list's first read and the family's last all-to-all may write the
    tensor it reads (the op reads the tensor at the all-to-all, not where the list was read)."""
    last = max((m.node for m in family.matches), key=order.__getitem__)
    for split in {s.base: s for m in family.matches for s in (m.recv, m.send)}.values():
        first = min((read_path(r)[2][0] if read_path(r)[2] else r for r in split.reads), key=order.__getitem__)
        if written_between(gm, split.base, first, last):
            return f"something between its reads and {last.name} may write {split.base.name}"
    return None


def _rows_of(graph: fx.Graph, tensor: fx.Node) -> int | fx.Node:
    """The first dimension of ``tensor``: an int where static, else a ``sym_size`` node right after it."""
    size = node_value(tensor).shape[0]
    if isinstance(size, int):
        return size
    # After a graph input: after the last of them (inputs come first).
    after = list(graph.find_nodes(op="placeholder"))[-1] if tensor.op == "placeholder" else tensor
    with graph.inserting_after(after):
        return graph.call_function(torch.ops.aten.sym_size.int, (tensor, 0))


class _Rows:
    """The rows each source stands for, made once (``sym_size`` nodes placed right after their tensor), from the
    op each all-to-all became (``add``)."""

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph
        self.ops: dict[int, fx.Node] = {}
        self.made: dict[tuple[str, int], int | fx.Node] = {}

    def add(self, m: SplitReads, op: fx.Node) -> None:
        self.ops[id(m)] = op

    def __call__(self, source: _Source) -> int | fx.Node:
        kind, m = source
        key = (kind, id(m))
        if key not in self.made:
            op = self.ops[id(m)]
            self.made[key] = _rows_of(self.graph, op.args[0] if kind == "input" else op)
        return self.made[key]


def _replace_all_to_alls(graph: fx.Graph, family: _Family, order: dict[fx.Node, int]) -> _Rows:
    """Each all-to-all becomes the op, in graph order (a combine's ``rows``: the rows an earlier one sends or
    returns, where its list is one of that one's); returns the rows of each."""
    rows = _Rows(graph)
    done: list[SplitReads] = []
    for m in sorted(family.matches, key=lambda m: order[m.node]):
        known = _sources(m.recv.total(), done)
        size = rows(known[0]) if known else None
        with graph.inserting_before(m.node):
            send, recv = _row(graph, m.send), _row(graph, m.recv)
            new = graph.call_function(SPLIT_ALL_TO_ALL, (all_to_all_args(m.node).input, send, recv,
                                                         m.group_name, size))
        new.meta.update(m.node.meta)
        m.node.replace_all_uses_with(new)
        graph.erase_node(m.node)
        while waits := [u for u in new.users if is_call(u, *WAIT)]:  # the op's result is complete
            for wait in waits:
                wait.replace_all_uses_with(new)
                graph.erase_node(wait)
        rows.add(m, new)
        done.append(m)
    return rows


def _row(graph: fx.Graph, split: SplitList) -> fx.Node:
    """``base[prefix]``: the tensor row the list was read from (a view; inserted at the graph's insert point)."""
    node = split.base
    for i in split.prefix:
        node = graph.call_function(operator.getitem, (node, i))
    return node


def _substitute(n: fx.Node, value_of: dict[fx.Node, object]) -> None:
    """``n``'s arguments and keyword arguments with the nodes of ``value_of`` replaced by their values."""
    n.args = fx.node.map_arg(n.args, lambda a: value_of.get(a, a))
    n.kwargs = fx.node.map_arg(n.kwargs, lambda a: value_of.get(a, a))


def _drop_reads(graph: fx.Graph, family: _Family) -> None:
    """The asserts about the reads (and the relations to other sizes with no rows to read), the reads as lifted
    symbols (any size will do: nothing reads them), the symbolic values now unused, and the reads with their
    index nodes."""
    zeros = dict.fromkeys(family.reads() | set(family.derived), 0)
    for n in family.lifted:
        _substitute(n, zeros)
    order = {n: i for i, n in enumerate(graph.nodes)}
    gone = {*family.asserts, *family.dropped, *family.derived}
    for n in sorted(gone, key=order.__getitem__, reverse=True):  # users come later: erased first
        graph.erase_node(n)
    for read in family.reads():
        node = read
        while not node.users:
            parent = node.args[0]
            graph.erase_node(node)
            if not (isinstance(parent, fx.Node) and index_step(parent) is not None):
                break
            node = parent


def _rewrite(gm: fx.GraphModule, family: _Family, order: dict[fx.Node, int]) -> None:
    """The family's all-to-alls become the op, the sums' readers read rows, the reads go."""
    rows = _replace_all_to_alls(gm.graph, family, order)
    for t in family.sums:
        _substitute(t.reader, {t.node: rows(family.sources[t])})
    _drop_reads(gm.graph, family)


def fold_split_reads(gm: fx.GraphModule) -> tuple[list[SplitReads], list[str]]:
    """Rewrite ``gm``'s all-to-alls whose split lists are tensor rows read on the host into
    ``relaymoe::split_all_to_all`` (module docstring). Returns what was rewritten, and why others were not."""
    matches, skipped = find_split_reads(gm)
    done: list[SplitReads] = []
    for family in _families(matches):
        # (Per family: an earlier family's rewrite may have given this one's all-to-alls new inputs.)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        names = ", ".join(m.node.name for m in family.matches)
        reason = _classify(family) or _choose_sources(order, family) or _base_written(gm, order, family)
        if reason is not None:
            skipped.append(f"{names}: {reason}")
            log.debug("split_reads: %s left as traced: %s", names, reason)
            continue
        _rewrite(gm, family, order)
        done.extend(family.matches)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done, skipped

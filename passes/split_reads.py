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
  (the collective checks its splits against its rows), symbolic values equal to the sum of one list (replaced by
  the rows of the tensor that list sizes), symbolic arithmetic used only by those, and higher-order ops whose
  subgraphs were handed them as shape symbols they compute nothing from. All-to-alls that share
  reads are taken together; where any read has another use (``torch.split(out, recv_splits)``, a loop over the
  counts), none of them is changed, and the reason is returned.
- Values and order are as traced: the op runs where the all-to-all ran; its reads come from the same tensors.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from relay_compile.passes.fx_nodes import ALL_TO_ALL, ASSERTS, WAIT, all_to_all_args, is_call, node_value, qualname
from relay_compile.passes.host_reads import _index, _is_read, _path
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
    input: fx.Node
    group_name: str
    recv: SplitList
    send: SplitList


@dataclass(frozen=True)
class _Sum:
    """A symbolic value equal to one split list's sum, read by tensor code (``feeds``): it reads the rows of the
    tensor that list sizes instead."""

    node: fx.Node
    total: sympy.Expr
    feeds: tuple[fx.Node, ...]


@dataclass
class _Family:
    """All-to-alls that share reads, and what the rewrite does to the other users of those reads."""

    matches: list[SplitReads]
    asserts: list[fx.Node] = field(default_factory=list)
    sums: list[_Sum] = field(default_factory=list)
    derived: list[fx.Node] = field(default_factory=list)  # symbolic values, erased once unused
    lifted: list[fx.Node] = field(default_factory=list)  # higher-order ops handed them only as shape symbols

    def reads(self) -> set[fx.Node]:
        return {r for m in self.matches for r in (*m.recv.reads, *m.send.reads)}


def _expr(n: fx.Node) -> sympy.Expr | None:
    v = node_value(n)
    if isinstance(v, int) and not isinstance(v, bool):
        return sympy.Integer(v)
    if isinstance(v, torch.SymInt):
        return v.node.expr
    return None


def _split_list(sizes: list[object]) -> SplitList | None:
    """``sizes`` as the elements of one tensor row read in order, else None."""
    if not sizes or not all(isinstance(s, fx.Node) and _is_read(s) for s in sizes):
        return None
    paths = [_path(s) for s in sizes]  # (base, path, chain)
    base, first, _ = paths[0]
    prefix = first[:-1]
    if any(b is not base or p != (*prefix, j) for j, (b, p, _) in enumerate(paths)) or _expr(sizes[0]) is None:
        return None
    return SplitList(base, prefix, tuple(sizes))  # type: ignore[arg-type]


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
                skipped.append(f"{n.name}: one split list is not a tensor row read in order")
            continue
        if not isinstance(a.group_name, str) or not isinstance(a.input, fx.Node):
            skipped.append(f"{n.name}: group {a.group_name!r} is not a group name")
        elif not _differentiable(n):
            skipped.append(f"{n.name}: {n.target} has no autograd in this torch, and its input needs a gradient")
        else:
            found.append(SplitReads(node=n, input=a.input, group_name=a.group_name, recv=recv, send=send))
    return found, skipped


def _families(matches: list[SplitReads]) -> list[_Family]:
    """Matches grouped by shared reads (a dispatch and its combine read the same lists)."""
    families: list[_Family] = []
    for m in matches:
        mine = {*m.recv.reads, *m.send.reads}
        joined = [f for f in families if f.reads() & mine]
        merged = _Family([x for f in joined for x in f.matches] + [m])
        families = [f for f in families if f not in joined] + [merged]
    return families


def _is_symbolic(n: fx.Node) -> bool:
    v = node_value(n)
    return isinstance(v, (torch.SymInt, torch.SymBool, torch.SymFloat, int, bool, float)) and not isinstance(
        v, torch.Tensor)


def _classify(family: _Family) -> str | None:
    """Fill ``family``'s other users of its reads; the reason it cannot be rewritten, else None."""
    rewritten = {m.node for m in family.matches}
    totals = {m.recv.total() for m in family.matches} | {m.send.total() for m in family.matches}
    seen: set[fx.Node] = set()
    todo = [u for r in family.reads() for u in r.users if u not in rewritten]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if is_call(n, *ASSERTS):
            family.asserts.append(n)
            continue
        if _lifted_only(n):
            family.lifted.append(n)
            continue
        if not _is_symbolic(n):
            name = qualname(n.target) or getattr(n.target, "__name__", n.target)
            return f"the split sizes are also read by {n.name} ({name})"
        family.derived.append(n)
        feeds = [u for u in n.users if not _is_symbolic(u) and not is_call(u, *ASSERTS)]
        if feeds and _expr(n) not in totals:
            return f"{n.name} ({_expr(n)}), computed from the split sizes, is read by {feeds[0].name}"
        if feeds:
            family.sums.append(_Sum(n, _expr(n), tuple(feeds)))
        todo.extend(u for u in n.users if u not in feeds)
    return None


def _lifted_only(n: fx.Node) -> bool:
    """``n`` calls a higher-order op (``autograd.Function``, checkpoint) whose subgraphs take symbolic sizes as
    inputs but compute nothing from them: Dynamo lifts the symbols of a tensor operand's shape into every
    subgraph it calls (transformers' ``_WaitTensor.apply(recv_tokens)`` takes the received rows' split sizes, its
    forward body returns them for the backward body, which reads none). So in every body a size placeholder at
    most reaches the body's output, and what the op returns to the graph are tensors only."""
    owner = n.graph.owning_module
    if n.op != "call_function" or not isinstance(n.target, torch._ops.HigherOrderOperator) or owner is None:
        return False
    bodies = [getattr(owner, str(a.target)) for a in n.args if isinstance(a, fx.Node) and a.op == "get_attr"]
    bodies = [b for b in bodies if isinstance(b, fx.GraphModule)]
    # A lifted symbol's placeholder is named after it in every body (the backward's carry no fake values).
    names = {p.name for b in bodies for p in b.graph.find_nodes(op="placeholder")
             if isinstance(node_value(p), torch.SymInt)}
    sizes = [p for b in bodies for p in b.graph.find_nodes(op="placeholder") if p.name in names]
    return (bool(bodies) and all(u.op == "output" for p in sizes for u in p.users)
            and all(isinstance(node_value(u), torch.Tensor) for u in n.users))


def _row(graph: fx.Graph, split: SplitList) -> fx.Node:
    """``base[prefix]``: the tensor row the list was read from (a view; inserted at the graph's insert point)."""
    node = split.base
    for i in split.prefix:
        node = graph.call_function(operator.getitem, (node, i))
    return node


def _rows_of(graph: fx.Graph, tensor: fx.Node) -> object:
    """The first dimension of ``tensor``: an int where static, else a ``sym_size`` node."""
    size = node_value(tensor).shape[0]
    if isinstance(size, int):
        return size
    return graph.call_function(torch.ops.aten.sym_size.int, (tensor, 0))


def _order_allows(order: dict[fx.Node, int], family: _Family) -> str | None:
    """A sum's readers read the rows of a tensor defined before them: a dispatch's input, an all-to-all's output."""
    for t in family.sums:
        first = min(order[f] for f in t.feeds)
        if not any((t.total == m.send.total() and order[m.input] < first)
                   or (t.total == m.recv.total() and order[m.node] < first) for m in family.matches):
            return f"{t.node.name} is read before the tensor whose rows it counts is computed"
    return None


def _rewrite(gm: fx.GraphModule, family: _Family) -> None:
    graph = gm.graph
    known: dict[sympy.Expr, Callable[[], object]] = {}  # a list's sum -> the rows it sizes, at the insert point
    order = {n: i for i, n in enumerate(graph.nodes)}
    for m in sorted(family.matches, key=lambda m: order[m.node]):
        with graph.inserting_before(m.node):
            send, recv = _row(graph, m.send), _row(graph, m.recv)
            rows = known[m.recv.total()]() if m.recv.total() in known else None
            new = graph.call_function(SPLIT_ALL_TO_ALL, (m.input, send, recv, m.group_name, rows))
        new.meta.update(m.node.meta)
        m.node.replace_all_uses_with(new)
        graph.erase_node(m.node)
        while waits := [u for u in new.users if is_call(u, *WAIT)]:  # the op's result is complete
            for wait in waits:
                wait.replace_all_uses_with(new)
                graph.erase_node(wait)
        known.setdefault(m.send.total(), lambda x=m.input: _rows_of(graph, x))
        known.setdefault(m.recv.total(), lambda y=new: _rows_of(graph, y))
    order = {n: i for i, n in enumerate(graph.nodes)}
    for t in family.sums:
        with graph.inserting_before(min(t.feeds, key=order.__getitem__)):
            rows = known[t.total]()
        for user in t.feeds:
            user.args = fx.node.map_arg(user.args, lambda a, n=t.node: rows if a is n else a)
            user.kwargs = fx.node.map_arg(user.kwargs, lambda a, n=t.node: rows if a is n else a)
    for n in family.asserts:
        graph.erase_node(n)
    gone = family.reads() | set(family.derived)
    for n in family.lifted:  # its subgraphs read none of them: any size will do
        n.args = fx.node.map_arg(n.args, lambda a: 0 if a in gone else a)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted(family.derived, key=order.__getitem__, reverse=True):
        if not n.users:  # users come later in the graph: erased before it
            graph.erase_node(n)
    for read in family.reads():
        _erase_unused_chain(graph, read)


def _erase_unused_chain(graph: fx.Graph, read: fx.Node) -> None:
    """``read`` and the index nodes above it, as far as nothing else uses them."""
    node = read
    while not node.users:
        parent = node.args[0]
        graph.erase_node(node)
        if not (isinstance(parent, fx.Node) and _index(parent) is not None):
            return
        node = parent


def fold_split_reads(gm: fx.GraphModule) -> tuple[list[SplitReads], list[str]]:
    """Rewrite ``gm``'s all-to-alls whose split lists are tensor rows read on the host into
    ``relaymoe::split_all_to_all`` (module docstring). Returns what was rewritten, and why others were not."""
    matches, skipped = find_split_reads(gm)
    done: list[SplitReads] = []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for family in _families(matches):
        names = ", ".join(m.node.name for m in family.matches)
        reason = _classify(family) or _order_allows(order, family)
        if reason is not None:
            skipped.append(f"{names}: {reason}")
            log.debug("split_reads: %s left as traced: %s", names, reason)
            continue
        _rewrite(gm, family)
        done.extend(family.matches)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done, skipped

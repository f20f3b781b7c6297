"""host_reads: one device-to-host copy per tensor whose elements a graph reads on the host.

An all-to-all dispatcher reads its split sizes on the host. Some read the device tensor itself
(``torch.stack([send, recv]).tolist()``: transformers' expert parallelism, the reference layer); torchtitan copies
it to the host first. Dynamo traces a device ``tolist`` into one ``t[i][j].item()`` per element, and aot_autograd
and inductor keep one ``_local_scalar_dense`` per element: on CUDA each is a stream sync and an 8-byte copy, so a
graph that keeps its all-to-alls (a region the cost model keeps, a refused one, a model the backend does not
rewrite) pays ``2 N`` syncs per call where eager paid one. At EP=64 on the H200 that made the compiled reference
layer 1.2-1.3x slower than eager at 8192 tokens per rank (docs/BENCHMARKS.md, "Kept regions"). This pass copies
each such tensor to the host once, where the first read was, and indexes the copy.

Before::

    getitem = splits_2N[0];  getitem_1 = getitem[0];  item = getitem_1.item()
    getitem_2 = getitem[1];  item_1 = getitem_2.item()

After::

    splits_2N_host = splits_2N.to('cpu', copy=True)
    getitem_3 = splits_2N_host[0];  getitem_4 = getitem_3[0];  item = getitem_4.item()
    getitem_5 = getitem_3[1];  item_1 = getitem_5.item()

Contract: the values read are the same, at the same point of the program (the copy syncs where the first
read did); the ``item`` nodes themselves stay, with their unbacked SymInts. Only reads through integer indexing
of a tensor on an accelerator are batched, only where a tensor has at least two, and only where nothing between
its first and its last read may write its storage.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from relay_compile.passes.fx_nodes import is_item

log = logging.getLogger(__name__)

__all__ = ["HostReads", "batch_host_reads", "find_host_reads", "index_step", "on_accelerator", "read_path",
           "written_between"]


@dataclass(frozen=True, kw_only=True)
class HostReads:
    """Host reads of one tensor's elements: ``base`` indexed by ``paths[i]`` (through the nodes
    ``chains[i]``, outermost first) then ``reads[i].item()``."""

    base: fx.Node
    reads: tuple[fx.Node, ...]
    paths: tuple[tuple[int, ...], ...]
    chains: tuple[tuple[fx.Node, ...], ...]


def on_accelerator(t: Tensor) -> bool:
    """Where a host read costs a device sync: any device but the CPU (and ``meta``, which holds no data)."""
    return t.device.type not in ("cpu", "meta")


def _value(node: fx.Node) -> object:
    return node.meta.get("example_value", node.meta.get("val"))


def index_step(node: fx.Node) -> tuple[fx.Node, int] | None:
    """``(input, i)`` where ``node`` is ``input[i]`` (``getitem`` or ``select(0, i)``), else None. (Dynamo records
    no example value for the index nodes of ``tolist``: whether ``input`` is a tensor is asked of the chain's
    base, ``read_path``.)"""
    if node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2:
        src, i = node.args
    elif node.op == "call_method" and node.target == "select" and node.args[1:2] == (0,) and len(node.args) == 3:
        src, i = node.args[0], node.args[2]
    else:
        return None
    if not isinstance(src, fx.Node) or not isinstance(i, int) or isinstance(i, bool):
        return None
    return src, i


def read_path(read: fx.Node) -> tuple[fx.Node, tuple[int, ...], tuple[fx.Node, ...]]:
    """The tensor ``read`` reads an element of, the indices that lead there and their index nodes."""
    node = read.args[0]
    path: list[int] = []
    chain: list[fx.Node] = []
    assert isinstance(node, fx.Node)
    while (step := index_step(node)) is not None:
        chain.append(node)
        node, i = step
        path.append(i)
    return node, tuple(reversed(path)), tuple(reversed(chain))


def find_host_reads(gm: fx.GraphModule, where: Callable[[Tensor], bool] | None = None) -> list[HostReads]:
    """The tensors of ``gm`` whose elements are read on the host more than once, each on a device ``where``
    accepts (default ``on_accelerator``); pure: nothing changes."""
    where = where or on_accelerator
    by_base: dict[fx.Node, list[tuple[fx.Node, tuple[int, ...], tuple[fx.Node, ...]]]] = {}
    for node in gm.graph.nodes:
        if is_item(node) and isinstance(node.args[0], fx.Node):
            base, path, chain = read_path(node)
            value = _value(base)
            if path and isinstance(value, Tensor) and where(value):
                by_base.setdefault(base, []).append((node, path, chain))
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    batched = []
    for base, found in by_base.items():
        reads = HostReads(base=base, reads=tuple(f[0] for f in found), paths=tuple(f[1] for f in found),
                          chains=tuple(f[2] for f in found))
        if len(found) < 2:
            continue
        if _written_between(gm, reads, order):
            log.debug("host_reads: %s left as it is: something between its reads may write it", base.name)
            continue
        batched.append(reads)
    return batched


def _written_between(gm: fx.GraphModule, reads: HostReads, order: dict[fx.Node, int]) -> bool:
    """Whether a node between the first and the last read may write ``reads.base``'s storage: one copy would then
    not hold what a later read reads."""
    first = min((chain[0] for chain in reads.chains), key=order.__getitem__)
    return written_between(gm, reads.base, first, max(reads.reads, key=order.__getitem__))


def written_between(gm: fx.GraphModule, base: fx.Node, first: fx.Node, last: fx.Node) -> bool:
    """Whether a node from ``first`` up to (not including) ``last`` may write ``base``'s storage (an in-place
    method, ``setitem``, ``out=``, a mutable op, a submodule, a higher-order op)."""
    nodes = list(gm.graph.nodes)
    storage = StorageWeakRef(_value(base).untyped_storage())
    for node in nodes[nodes.index(first):nodes.index(last)]:
        for written in _writes(node):
            value = _value(written) if isinstance(written, fx.Node) else None
            scalar = isinstance(value, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool))
            if scalar or _subgraph(gm, written):
                continue  # no storage: a scalar (a lifted shape symbol), a higher-order op's body
            if not isinstance(value, Tensor) or StorageWeakRef(value.untyped_storage()) == storage:
                return True
    return False


def _subgraph(gm: fx.GraphModule, n: object) -> bool:
    """``n`` is a ``get_attr`` of a submodule graph (the body a higher-order op runs)."""
    return isinstance(n, fx.Node) and n.op == "get_attr" and isinstance(getattr(gm, str(n.target), None),
                                                                          fx.GraphModule)


# Python's augmented assignments: Dynamo records ``c += 1`` on a tensor as ``operator.iadd(c, 1)``.
_IN_PLACE_OPERATORS = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.imatmul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.ilshift, operator.irshift, operator.iand, operator.ior, operator.ixor,
    operator.setitem,
})


def _mutable(target: object) -> bool:
    """An op whose schema writes an argument (any overload of a packet: Dynamo records packets)."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    if isinstance(target, torch._ops.OpOverloadPacket):
        return any(getattr(target, o)._schema.is_mutable for o in target.overloads())
    return False


def _in_place_name(name: str) -> bool:
    """``add_``, ``index_put_``, ``_foreach_add_``, ``__iadd__``, ``__setitem__``; not ``__add__``."""
    if name.startswith("__") and name.endswith("__"):
        return name.startswith("__i") or name == "__setitem__"
    return name.endswith("_")


def _writes(node: fx.Node) -> list[object]:
    """What ``node`` may write in place (conservatively: every input of a submodule, a higher-order op or a
    mutable op)."""
    target = node.target
    if node.op == "call_module" or isinstance(target, torch._ops.HigherOrderOperator) or _mutable(target):
        return list(node.all_input_nodes)
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if target in _IN_PLACE_OPERATORS or (node.op in ("call_method", "call_function") and _in_place_name(name)):
        return [node.args[0]] if node.args else []
    return [node.kwargs["out"]] if "out" in node.kwargs else []


def _with_value(node: fx.Node, value: object) -> fx.Node:
    node.meta["example_value"] = node.meta["val"] = value
    return node


def _insert_copy(gm: fx.GraphModule, found: HostReads, order: dict[fx.Node, int]) -> fx.Node:
    """The copy and the new index chains, before the first old one (where the first sync was; ``order``: the
    graph's nodes before any insertion, whose relative order insertions keep)."""
    graph, base_value = gm.graph, _value(found.base)
    assert isinstance(base_value, Tensor)
    first = min((chain[0] for chain in found.chains), key=order.__getitem__)
    chains: dict[tuple[int, ...], fx.Node] = {}
    # Dynamo's example values are fake tensors: the new nodes' values come from the same fake mode.
    mode = getattr(base_value, "fake_mode", None)
    with graph.inserting_before(first), mode if mode is not None else contextlib.nullcontext():
        # copy=True: a copy also where the tensor is already on the host (the CPU tests read a real copy).
        host = _with_value(graph.create_node("call_method", "to", (found.base, "cpu"), {"copy": True},
                                             name=f"{found.base.name}_host"), base_value.to("cpu", copy=True))
        chains[()] = host
        for read, path in zip(found.reads, found.paths, strict=True):
            for depth in range(1, len(path) + 1):
                if path[:depth] not in chains:
                    parent = chains[path[:depth - 1]]
                    chains[path[:depth]] = _with_value(graph.call_function(operator.getitem, (parent, path[depth - 1])),
                                                       _value(parent)[path[depth - 1]])
            old = read.args[0]
            read.replace_input_with(old, chains[path])
    return host


def batch_host_reads(gm: fx.GraphModule, where: Callable[[Tensor], bool] | None = None) -> list[HostReads]:
    """Rewrite ``gm`` so each tensor ``find_host_reads`` names is copied to the host once and read there; the
    replaced index chains are removed. Returns what it batched."""
    found = find_host_reads(gm, where)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for reads in found:
        host = _insert_copy(gm, reads, order)
        log.debug("host_reads: %d reads of %s from one copy %s", len(reads.reads), reads.base.name, host.name)
    if found:
        _erase_unused({node for reads in found for chain in reads.chains for node in chain}, gm.graph)
        gm.graph.lint()
        gm.recompile()
    return found


def _erase_unused(nodes: set[fx.Node], graph: fx.Graph) -> None:
    """The replaced index nodes no one uses any more (views: nothing else can depend on them)."""
    for node in reversed(list(graph.nodes)):
        if node in nodes and not node.users:
            graph.erase_node(node)

"""Hand-built FX graphs shaped like Dynamo's, with fake values, for unit tests of the graph passes.

``FakeGraph`` builds an ``fx.Graph`` node by node; each node's ``meta["val"]`` is computed by running its target
on the fake values of its arguments (``FakeTensorMode`` over a ``ShapeEnv``), so shapes and dtypes are those a
real trace would record. ``.item()`` gives a fresh unbacked SymInt, as under
``torch._dynamo.config.capture_scalar_outputs=True``. Targets are the ones Dynamo emits: the
``torch.ops._c10d_functional`` OpOverloadPackets, ``operator.getitem``/``floordiv``/``mul``, ``torch.argsort``,
call_method ``view``/``flatten``/``index_add``...

``moe_graph(**steps)`` builds the reference all-to-all MoE block (``relay_compile.reference.a2a_moe``, abridged)
one step at a time; a test replaces a step by its own function ``step(r)`` that reads and sets the nodes on
``r`` (a ``Region``), to change one thing about the graph:

    inputs    x (T, H), router gate (H, E), expert weights w1 (H, F), w2 (F, H)
    router    topk = torch.topk(torch.softmax(x @ gate, -1), K, dim=-1); scores, ids = topk[0], topk[1]
    counts    counts_E = zeros(E).scatter_add_(ids.flatten().to(int64)); exchange = a2a(counts_E, [E_l] * N);
              counts = wait(exchange).view(N, -1); send_splits / recv_splits: per-rank totals, .item() each
    permute   order = torch.argsort(ids.flatten(), stable=True); send = x[order // K]
    dispatch  recv = wait(a2a(send, recv_splits, send_splits, group))
    experts   out = silu(recv @ w1) @ w2
    combine   back = wait(a2a(out, send_splits, recv_splits, group))
    scatter   y = torch.zeros_like(x).index_add(0, order // K, back * scores.flatten()[order][:, None])

Legend: T tokens, H hidden, F expert FFN width, K top-k, N ranks, E experts, E_l = E / N experts per rank,
P = T * K pairs.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as nnf
from torch import fx
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

__all__ = [
    "A2A", "STEPS", "WAIT", "Dims", "FakeGraph", "Region", "add_moe_region", "check_sends_all_pairs", "combine",
    "dispatch", "exchange_counts", "experts", "graph_snapshot", "inputs", "items_of", "local_counts", "moe_graph",
    "permute", "router", "scatter", "score_column", "send_splits", "slice_sums", "summed_items",
]

_fc = torch.ops._c10d_functional
A2A = _fc.all_to_all_single  # the OpOverloadPacket, as Dynamo emits it
WAIT = _fc.wait_tensor


class FakeGraph:
    """An ``fx.Graph`` under construction whose nodes carry fake values in ``meta["val"]``."""

    def __init__(self) -> None:
        self.shape_env = ShapeEnv()
        self.mode = FakeTensorMode(shape_env=self.shape_env)
        self.graph = fx.Graph()
        self.submodules: dict[str, torch.nn.Module] = {}  # what get_attr nodes read (higher-order op bodies)

    def input(self, name: str, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> fx.Node:
        """A tensor placeholder."""
        node = self._placeholder(name)
        with self.mode:
            node.meta["val"] = torch.empty(tuple(shape), dtype=dtype)
        return node

    def int_input(self, name: str, hint: int) -> fx.Node:
        """An int placeholder that Dynamo made dynamic (a backed SymInt)."""
        node = self._placeholder(name)
        symbol = self.shape_env.create_symbol(hint, ConstantSource(name))
        node.meta["val"] = self.shape_env.create_symintnode(symbol, hint=hint)
        return node

    def fn(self, target: Callable[..., Any], *args: Any, name: str | None = None, **kwargs: Any) -> fx.Node:
        """A call_function node."""
        return self._node("call_function", target, args, kwargs, name)

    def method(self, target: str, *args: Any, name: str | None = None, **kwargs: Any) -> fx.Node:
        """A call_method node (``args[0]`` is the object)."""
        return self._node("call_method", target, args, kwargs, name)

    def item(self, t: fx.Node, name: str | None = None) -> fx.Node:
        """``t.item()``: a host read, an unbacked SymInt (Dynamo's ``capture_scalar_outputs=True``)."""
        node = self.graph.create_node("call_method", "item", (t,), name=name)
        node.meta["val"] = self.shape_env.create_unbacked_symint()
        return node

    def check(self, cond: fx.Node) -> fx.Node:
        """``torch._check(cond)``: Dynamo's ``aten._assert_scalar`` node; the fact also enters the shape env."""
        torch._check(cond.meta["val"])
        node = self.graph.call_function(torch.ops.aten._assert_scalar.default, (cond, f"assert {cond.name}"))
        node.meta["val"] = None
        return node

    def a2a(self, t: fx.Node, out_splits: Sequence[Any], in_splits: Sequence[Any], group: str,
            names: tuple[str | None, str | None] = (None, None)) -> tuple[fx.Node, fx.Node]:
        """``(a2a, wait)``: ``funcol.wait_tensor(funcol.all_to_all_single(t, out_splits, in_splits, group))``."""
        a2a = self.fn(A2A, t, list(out_splits), list(in_splits), group, name=names[0])
        return a2a, self.fn(WAIT, a2a, name=names[1])

    def function_a2a(self, t: fx.Node, out_splits: Sequence[Any], in_splits: Sequence[Any], group: str,
                     names: tuple[str | None, str | None] = (None, None), *, twice: bool = False,
                     split_inside: bool = False) -> tuple[fx.Node, fx.Node]:
        """``(apply, getitem(apply, 0))``: Megatron's ``_AllToAll.apply(group, t, out_splits, in_splits)`` as Dynamo
        traces it, ``autograd_function_apply(fwd_body, bwd_body, t, *out_splits, *in_splits)`` whose forward is
        ``buf = t.new_empty(...); buf.copy_(wait(all_to_all_single(t.contiguous(), ...)))``; ``twice``: a second
        all-to-all in the forward; ``split_inside``: the first output split computed inside the forward."""
        body = FakeGraph()
        # Row counts are not read from the body (symbolic outside it): any static stand-in will do.
        shape = (1, *(int(d) for d in t.meta["val"].shape[1:]))
        t_in = body.input("input", shape, dtype=t.meta["val"].dtype)
        outs = [body.int_input(f"out{i}", 1) for i in range(len(out_splits))]
        ins = [body.int_input(f"in{i}", 1) for i in range(len(in_splits))]
        sent = body.method("contiguous", t_in)
        if split_inside:
            outs[0] = body.fn(operator.mul, outs[0], 1)
        buf = body.method("new_empty", sent, [body.fn(torch.sym_sum, outs), *shape[1:]])
        _, result = body.a2a(sent, outs, ins, group)
        if twice:
            _, result = body.a2a(result, ins, outs, group)
        body.method("copy_", buf, result)
        body.graph.output(((buf,), tuple(ins)))
        fwd = fx.GraphModule(torch.nn.Module(), body.graph)
        refs = []
        for kind in ("fwd_body", "bwd_body"):  # the backward body is never read: the forward stands in
            attr = f"{kind}_{len(self.submodules) // 2}"
            self.submodules[attr] = fwd
            refs.append(self.graph.get_attr(attr))
        apply = self.graph.call_function(
            torch.ops.higher_order.autograd_function_apply, (*refs, t, *out_splits, *in_splits),
            {"non_differentiable_idx": [], "saved_for_backward_idx": []}, name=names[0])
        with self.mode:
            rows = sum(s.meta["val"] for s in out_splits)
            apply.meta["val"] = (t.meta["val"].new_empty((rows, *t.meta["val"].shape[1:])),)
        first = self.graph.call_function(operator.getitem, (apply, 0), name=names[1])
        first.meta["val"] = apply.meta["val"][0]
        return apply, first

    def module(self, outputs: Sequence[fx.Node]) -> fx.GraphModule:
        """Close the graph with ``return (outputs...)`` (Dynamo returns a tuple) and wrap it."""
        self.graph.output(tuple(outputs))
        self.graph.lint()
        root = torch.nn.Module()
        for name, sub in self.submodules.items():
            root.add_module(name, sub)
        return fx.GraphModule(root, self.graph)

    def _placeholder(self, name: str) -> fx.Node:
        node = self.graph.placeholder(name)
        node.target = node.name  # a second block's ``w1`` is ``w1_1``, in the signature too
        return node

    def _node(self, op: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str | None) -> fx.Node:
        node = self.graph.create_node(op, target, args, kwargs, name=name)
        vargs, vkwargs = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        with self.mode:
            node.meta["val"] = getattr(vargs[0], target)(*vargs[1:], **vkwargs) if op == "call_method" \
                else target(*vargs, **vkwargs)
        return node


@dataclass(frozen=True)
class Dims:
    """Sizes of a block (see the legend); the defaults make every shape distinct where it matters."""

    T: int = 6
    H: int = 8
    F: int = 4
    K: int = 2
    N: int = 2
    E: int = 4

    @property
    def E_l(self) -> int:
        return self.E // self.N


@dataclass(kw_only=True)
class Region:
    """The nodes of one MoE block as the steps build them (None until the step that sets them ran)."""

    b: FakeGraph
    dims: Dims
    group: str
    counts_group: str
    dtype: torch.dtype
    x: fx.Node | None = None
    gate: fx.Node | None = None
    w1: fx.Node | None = None
    w2: fx.Node | None = None
    ids: fx.Node | None = None
    scores: fx.Node | None = None
    counts_E: fx.Node | None = None
    exchange: fx.Node | None = None
    counts: fx.Node | None = None
    send_splits: list[fx.Node] = field(default_factory=list)
    recv_splits: list[fx.Node] = field(default_factory=list)
    order: fx.Node | None = None
    send: fx.Node | None = None
    dispatch: fx.Node | None = None
    recv: fx.Node | None = None
    out: fx.Node | None = None
    combine: fx.Node | None = None
    back: fx.Node | None = None
    y: fx.Node | None = None
    extra: dict[str, fx.Node] = field(default_factory=dict)  # nodes a test's own steps add, by name


# ----------------------------------------------------------------------------------------------------------
# Default steps: the reference layer
# ----------------------------------------------------------------------------------------------------------


def inputs(r: Region) -> None:
    d, b = r.dims, r.b
    if r.x is None:  # else the tokens are an earlier block's output
        r.x = b.input("x", (d.T, d.H), r.dtype)
    r.gate = b.input("gate", (d.H, d.E), r.dtype)
    r.w1 = b.input("w1", (d.H, d.F), r.dtype)
    r.w2 = b.input("w2", (d.F, d.H), r.dtype)


def router(r: Region) -> None:
    b = r.b
    probs = b.fn(torch.softmax, b.fn(operator.matmul, r.x, r.gate), dim=-1)
    topk = b.fn(torch.topk, probs, r.dims.K, dim=-1)
    r.scores = b.fn(operator.getitem, topk, 0, name="scores")
    r.ids = b.fn(operator.getitem, topk, 1, name="ids")


def local_counts(r: Region) -> fx.Node:
    """``zeros(E).scatter_add_(0, ids_P, ones_like(ids_P))``: pairs per global expert (int64)."""
    b = r.b
    ids_P = b.method("to", b.method("flatten", r.ids), torch.int64)
    zeros = b.fn(torch.zeros, r.dims.E, dtype=torch.int64)
    return b.method("scatter_add_", zeros, 0, ids_P, b.fn(torch.ones_like, ids_P), name="counts_E")


def items_of(r: Region, totals: fx.Node) -> list[fx.Node]:
    """``[totals[s].item() for s]``, each checked ``>= 0`` as the reference does (``torch._check``)."""
    b = r.b
    out = []
    for s in range(totals.meta["val"].shape[0]):
        u = b.item(b.fn(operator.getitem, totals, s))
        b.check(b.fn(operator.ge, u, 0))
        out.append(u)
    return out


def summed_items(r: Region, t: fx.Node, indices: Sequence[Any], name: str | None = None) -> fx.Node:
    """``torch.sym_sum([t[i].item() for i in indices])`` (Dynamo folds ``sum(...)`` of SymInts into it)."""
    b = r.b
    return b.fn(torch.sym_sum, [b.item(b.fn(operator.getitem, t, i), name=name and f"{name}{i}") for i in indices])


def slice_sums(r: Region, t: fx.Node, bounds: Sequence[int]) -> list[fx.Node]:
    """``[t[lo:hi].sum().item() for lo, hi in pairs of bounds]``: totals of consecutive slices, on the host."""
    b = r.b
    return [b.item(b.method("sum", b.fn(operator.getitem, t, slice(lo, hi)))) for lo, hi in pairwise(bounds)]


def send_splits(r: Region) -> list[fx.Node]:
    """``counts_E.view(N, -1).sum(1)``, read on the host: the pairs this rank sends to each rank."""
    return items_of(r, r.b.method("sum", r.b.method("view", r.counts_E, r.dims.N, -1), 1))


def check_sends_all_pairs(r: Region) -> None:
    """``torch._check(sum(send_splits) == T * K)``: Dynamo's check that the send splits cover the send buffer."""
    b = r.b
    b.check(b.fn(operator.eq, b.fn(torch.sym_sum, r.send_splits), r.dims.T * r.dims.K))


def exchange_counts(r: Region) -> None:
    """The reference's counts exchange (``AllToAllMoE``: ``_exchange_counts`` and ``_split_sizes``)."""
    b, d = r.b, r.dims
    r.counts_E = local_counts(r)
    splits = [d.E_l] * d.N
    r.exchange, wait = b.a2a(r.counts_E, splits, splits, r.counts_group, names=("exchange", None))
    r.counts = b.method("view", wait, d.N, -1, name="counts")
    r.send_splits = send_splits(r)
    r.recv_splits = items_of(r, b.method("sum", r.counts, 1))
    check_sends_all_pairs(r)


def permute(r: Region) -> None:
    b = r.b
    r.order = b.fn(torch.argsort, b.method("flatten", r.ids), stable=True, name="order")
    r.send = b.fn(operator.getitem, r.x, b.fn(operator.floordiv, r.order, r.dims.K), name="send")


def dispatch(r: Region) -> None:
    r.dispatch, r.recv = r.b.a2a(r.send, r.recv_splits, r.send_splits, r.group, names=("dispatch", "recv"))


def experts(r: Region) -> None:
    b = r.b
    h = b.fn(nnf.silu, b.fn(operator.matmul, r.recv, r.w1))
    r.out = b.fn(operator.matmul, h, r.w2, name="out")


def combine(r: Region) -> None:
    r.combine, r.back = r.b.a2a(r.out, r.send_splits, r.recv_splits, r.group, names=("combine", "back"))


def score_column(r: Region) -> fx.Node:
    """``scores.flatten()[order][:, None]``: each sorted pair's score, as a column."""
    b = r.b
    scores_P = b.fn(operator.getitem, b.method("flatten", r.scores), r.order)
    return b.fn(operator.getitem, scores_P, (slice(None), None))


def scatter(r: Region) -> None:
    b = r.b
    weighted = b.fn(operator.mul, r.back, score_column(r), name="weighted")
    token = b.fn(operator.floordiv, r.order, r.dims.K)
    r.y = b.method("index_add", b.fn(torch.zeros_like, r.x), 0, token, weighted, name="y")


STEPS: dict[str, Callable[[Region], None]] = {
    "inputs": inputs, "router": router, "counts": exchange_counts, "permute": permute, "dispatch": dispatch,
    "experts": experts, "combine": combine, "scatter": scatter,
}


def add_moe_region(
    b: FakeGraph,
    *,
    x: fx.Node | None = None,
    dims: Dims = Dims(),
    group: str = "ep",
    counts_group: str | None = None,
    dtype: torch.dtype = torch.float32,
    **steps: Callable[[Region], None] | None,
) -> Region:
    """Append one MoE block to ``b``; ``steps`` replace default steps by name (None: skip the step)."""
    unknown = set(steps) - set(STEPS)
    assert not unknown, f"unknown steps {unknown}"
    r = Region(b=b, dims=dims, group=group, counts_group=counts_group or group, dtype=dtype, x=x)
    for name, default in STEPS.items():
        step = steps.get(name, default)
        if step is not None:
            step(r)
    return r


def moe_graph(
    *, outputs: Callable[[Region], Sequence[fx.Node]] = lambda r: [r.y], **kwargs: Any
) -> tuple[fx.GraphModule, Region]:
    """One MoE block as a whole graph: ``(gm, r)``; ``kwargs`` as ``add_moe_region``."""
    b = FakeGraph()
    r = add_moe_region(b, **kwargs)
    return b.module(outputs(r)), r


def graph_snapshot(gm: fx.GraphModule) -> list[tuple[Any, ...]]:
    """What a pass could change about a graph: per node, its name, op, target, args, kwargs, users and meta."""
    return [
        (n.name, n.op, n.target, repr(n.args), repr(n.kwargs), [u.name for u in n.users], sorted(n.meta),
         id(n.meta.get("val")))
        for n in gm.graph.nodes
    ]

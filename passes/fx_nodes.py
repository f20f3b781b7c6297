"""fx_nodes: what the graph passes need to read FX nodes: op identities, fake values, narrowing predicates.

Nothing here knows about MoE. Predicates that take ``object`` (an argument of a node may be a node, a
constant or a container) return ``TypeGuard[fx.Node]``, so code after a successful check reads ``n.args``
without casts.

Fake values: ``node_value`` is the one lookup. ``meta["val"]`` first (make_fx and aot_autograd set it; it is
authoritative where both exist), then Dynamo's ``meta["example_value"]``; a constant argument is its own value.

Sizes: under dynamic shapes a size is a SymInt (``T`` after Dynamo's automatic dynamic or with
``dynamic=True``; a size argument is then a node whose value is one). ``static_int`` reads a constant size
without guessing from the hint; ``same_size``/``same_shape`` compare sizes, guarding the equality of two
backed sizes (Dynamo gives ``x``, ``ids`` and ``scores`` separate symbols for one T after a recompile) and
never raising on unbacked ones.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, TypeGuard, cast

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import guard_or_false, is_concrete_int

from relay_compile.runtime.block_shape import BlockShape

# ----------------------------------------------------------------------------------------------------------
# Op identities
# ----------------------------------------------------------------------------------------------------------

C10D_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d_functional", "c10d")


def op_variants(ns: str, name: str) -> tuple[Any, ...]:
    """The ``OpOverloadPacket`` and its ``.default`` (Dynamo emits the packet, make_fx the overload)."""
    namespace = getattr(torch.ops, ns, None)
    packet = getattr(namespace, name, None) if namespace is not None else None
    if packet is None:
        return ()
    return (packet, packet.default)


# torch 2.11's all_to_all_single_autograd traces to the _c10d_functional_autograd variant (no top-level wait).
ALL_TO_ALL = (
    *op_variants("_c10d_functional", "all_to_all_single"),
    *op_variants("_c10d_functional_autograd", "all_to_all_single"),
)
WAIT = op_variants("_c10d_functional", "wait_tensor")
ALL_GATHER = op_variants("_c10d_functional", "all_gather_into_tensor")
ASSERTS = (
    *op_variants("aten", "_assert_scalar"), *op_variants("aten", "_assert_async"),
    *op_variants("aten", "sym_constrain_range_for_size"), torch._check, torch._check_is_size,
)
LOCAL_SCALAR_DENSE = op_variants("aten", "_local_scalar_dense")


def qualname(target: object) -> str | None:
    """``"ns::name"`` of an OpOverload(Packet), else None."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def op_namespace(target: object) -> str | None:
    name = qualname(target)
    return name.split("::")[0] if name else None


# ----------------------------------------------------------------------------------------------------------
# Values and arguments
# ----------------------------------------------------------------------------------------------------------


def node_value(n: object) -> Any:
    """The fake value of a node (``val``, else ``example_value``), or the argument itself if not a node."""
    if isinstance(n, fx.Node):
        return n.meta.get("val", n.meta.get("example_value"))
    return n


def shape_of(n: object) -> tuple[Any, ...] | None:
    v = node_value(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def dtype_of(n: object) -> torch.dtype | None:
    v = node_value(n)
    return v.dtype if isinstance(v, torch.Tensor) else None


def size_value(n: object) -> int | torch.SymInt | None:
    """A size argument's value: an int, or the SymInt of a node (``t.size(1)``, a SymInt input); else None."""
    v = node_value(n)
    return v if isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool) else None


def size_hint(size: int | torch.SymInt) -> int | None:
    """A size as an int without guarding on it: a symbolic size's hint (its value at this compilation), None
    for a size that has none (data-dependent, unbacked)."""
    if isinstance(size, torch.SymInt):
        return int(size.node.hint) if size.node.has_hint() else None
    return int(size)


def report_size(size: int | torch.SymInt | None) -> int:
    """A size for the report: its hint, 0 when it has none (an unbacked or unknown size)."""
    return 0 if size is None else size_hint(size) or 0


def block_shape(
    x: fx.Node, weights: Sequence[fx.Node], *, top_k: int, experts_per_rank: int, group_size: int,
    matrices_per_expert: int,
) -> BlockShape:
    """Sizes of an MoE block on this rank from its nodes' fake values (the report's ``BlockShape``): tokens and
    hidden from ``x``, F from the weights, which hold ``matrices_per_expert`` (F, H) matrices per expert."""
    x_val = node_value(x)
    weight_vals = [node_value(w) for w in weights]
    hidden = report_size(x_val.shape[1])
    weight_elems = sum(report_size(w.numel()) for w in weight_vals) // experts_per_rank
    return BlockShape(
        tokens=report_size(x_val.shape[0]), hidden=hidden, top_k=top_k,
        ffn=weight_elems // max(1, hidden * matrices_per_expert), experts_per_rank=experts_per_rank,
        group_size=group_size, elem_bytes=x_val.element_size(),
        expert_bytes=weight_elems * weight_vals[0].element_size(), expert_params=weight_elems,
    )


def static_int(n: object) -> int | None:
    """A size that is the same int at every call: an int, or a SymInt whose expression is a constant."""
    v = size_value(n)
    # int() of a constant SymInt adds no guard; is_concrete_int reads the expression, not the hint.
    return int(v) if v is not None and is_concrete_int(v) else None


def same_size(a: object, b: object) -> bool:
    """Sizes (ints, SymInts or nodes of them) that the compiled graph may take as equal.

    Equal statically; else, for two backed sizes, as at this call, under a guard (equal or unequal) that the
    compiled graph keeps: Dynamo recompiles a call that decides otherwise, as for Inductor's guards. Unbacked
    sizes not known equal are unequal. Never ``bool(a == b)``: that raises on unbacked sizes.
    """
    va, vb = size_value(a), size_value(b)
    return va is not None and vb is not None and guard_or_false(va == vb)


def same_shape(a: Sequence[object] | None, b: Sequence[object] | None) -> bool:
    """Shapes (from ``shape_of``) of equal length, ``same_size`` in every dimension; None matches nothing."""
    return a is not None and b is not None and len(a) == len(b) and all(map(same_size, a, b))


def arg(n: fx.Node, index: int, name: str, default: object = None) -> object:
    """Argument ``index`` of ``n``, positional or by keyword ``name``."""
    if len(n.args) > index:
        return n.args[index]
    return n.kwargs.get(name, default)


def as_list(v: object) -> list[object]:
    """A list/tuple argument as a list; anything else (None) as ``[]``."""
    return list(v) if isinstance(v, (list, tuple)) else []


def flat_nodes(values: Iterable[object]) -> list[fx.Node]:
    """The nodes inside ``values`` (nested in lists, tuples and dicts)."""
    out: list[fx.Node] = []
    fx.node.map_arg(cast(fx.node.Argument, tuple(values)), out.append)
    return out


def describe(n: fx.Node) -> str:
    """``name (op target)`` for messages."""
    target = n.target if isinstance(n.target, str) else qualname(n.target) or getattr(n.target, "__name__", None)
    return f"{n.name} ({n.op} {target or n.target})"


# ----------------------------------------------------------------------------------------------------------
# Predicates
# ----------------------------------------------------------------------------------------------------------


def is_call(n: object, *targets: object) -> TypeGuard[fx.Node]:
    """``n`` is a ``call_function`` node of one of ``targets`` (compared by identity)."""
    return isinstance(n, fx.Node) and n.op == "call_function" and any(n.target is t for t in targets)


def is_method_call(n: object, *names: str) -> TypeGuard[fx.Node]:
    """``n`` is a ``call_method`` node of one of ``names``."""
    return isinstance(n, fx.Node) and n.op == "call_method" and n.target in names


def is_all_to_all(n: object) -> TypeGuard[fx.Node]:
    """An ``all_to_all_single``, or a user ``autograd.Function`` whose forward is one (``function_all_to_all``)."""
    return is_call(n, *ALL_TO_ALL) or isinstance(function_all_to_all(n), AllToAllArgs)


def is_function_apply(n: object) -> TypeGuard[fx.Node]:
    """Dynamo's ``autograd_function_apply(fwd_body, bwd_body, *operands)`` of a user ``torch.autograd.Function``."""
    return isinstance(n, fx.Node) and n.op == "call_function" and getattr(n.target, "__name__", "") == (
        "autograd_function_apply")


def is_collective(n: fx.Node) -> bool:
    return n.op == "call_function" and op_namespace(n.target) in C10D_NAMESPACES


def is_item(n: object) -> TypeGuard[fx.Node]:
    """A host sync producing a SymInt: ``t.item()`` (Dynamo) or ``aten._local_scalar_dense`` (make_fx)."""
    return is_method_call(n, "item") or is_call(n, *LOCAL_SCALAR_DENSE)


def is_assert(n: fx.Node) -> bool:
    return n.op == "call_function" and any(n.target is t for t in ASSERTS)


def is_mutator(n: fx.Node) -> bool:
    """An in-place write into its first argument: ``setitem``, ``t.foo_()``, or a mutating OpOverload."""
    if n.op == "call_function" and n.target is operator.setitem:
        return True
    if n.op == "call_method" and isinstance(n.target, str):
        return n.target.endswith("_") and not n.target.startswith("_")
    if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
        args = n.target._schema.arguments
        return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write
    return False


# ----------------------------------------------------------------------------------------------------------
# Collectives and dataflow
# ----------------------------------------------------------------------------------------------------------


class AllToAllArgs(NamedTuple):
    """The arguments of an ``all_to_all_single`` node."""

    input: object
    output_split_sizes: list[object]
    input_split_sizes: list[object]
    group_name: object


def all_to_all_args(n: fx.Node) -> AllToAllArgs:
    """The arguments of an all-to-all; of a user ``autograd.Function``'s, in terms of the graph that calls it."""
    found = function_all_to_all(n)
    if isinstance(found, AllToAllArgs):
        return found
    return AllToAllArgs(
        arg(n, 0, "input"),
        as_list(arg(n, 1, "output_split_sizes")),
        as_list(arg(n, 2, "input_split_sizes")),
        arg(n, 3, "group_name"),
    )


def _body(n: fx.Node, index: int) -> fx.GraphModule | None:
    """The subgraph a higher-order op reads through its ``get_attr`` argument ``index``."""
    ref = n.args[index] if len(n.args) > index else None
    owner = n.graph.owning_module
    if not (isinstance(ref, fx.Node) and ref.op == "get_attr" and owner is not None):
        return None
    body = getattr(owner, str(ref.target), None)
    return body if isinstance(body, fx.GraphModule) else None


def checkpoint_body(n: object) -> fx.GraphModule | None:
    """The body ``n`` runs when it is ``tag_activation_checkpoint(body, *operands)``, Dynamo's
    ``torch.utils.checkpoint`` call; else None."""
    if not is_call(n, torch.ops.higher_order.tag_activation_checkpoint):
        return None
    return _body(n, 0)


def subgraph_all_to_alls(n: fx.Node) -> str | None:
    """Why ``n``, a higher-order op other than ``autograd_function_apply`` and ``tag_activation_checkpoint``
    (whose bodies are matched in their own scope, ``passes.scopes``): ``wrap``, control flow, ..., hides
    all-to-alls from the matcher: they sit in its subgraphs, which the matcher does not read; None if it holds
    none."""
    if (n.op != "call_function" or not isinstance(n.target, torch._ops.HigherOrderOperator)
            or is_function_apply(n) or checkpoint_body(n) is not None):
        return None
    found = []
    for index in range(len(n.args)):
        body = _body(n, index)
        if body is not None:
            found += [f"{body.__class__.__name__}.{m.name}" for m in body.graph.nodes if is_call(m, *ALL_TO_ALL)]
    if not found:
        return None
    op = getattr(n.target, "__name__", str(n.target))
    return (f"all-to-alls {found} are inside the subgraph of the higher-order op {n.name} ({op}), which the matcher "
            "does not read: that MoE block runs unchanged")


def is_fresh(n: object) -> TypeGuard[fx.Node]:
    """A new uninitialized or zero buffer: ``t.new_empty(...)``, ``torch.empty_like(t)``, ``torch.zeros(...)``..."""
    return is_method_call(n, "new_empty", "new_zeros") or is_call(
        n, torch.empty, torch.empty_like, torch.zeros, torch.zeros_like)


def _written_by_copy(buffer: fx.Node) -> fx.Node | None:
    """What ``buffer.copy_(src)`` wrote into ``buffer`` (the last such copy), else None."""
    copies = [u for u in buffer.users if is_method_call(u, "copy_") and u.args[0] is buffer]
    return copies[-1].args[1] if copies and isinstance(copies[-1].args[1], fx.Node) else None


def function_all_to_all(n: object) -> AllToAllArgs | str | None:
    """A user ``torch.autograd.Function`` whose forward is one all-to-all (Megatron's and DeepSpeed's
    ``_AllToAll``): its arguments in terms of the calling graph; the backward, the reverse all-to-all, is not read.

    ``n`` is ``autograd_function_apply(fwd_body, bwd_body, *operands)``; the forward body returns the
    ``all_to_all_single`` result, directly or as the buffer it was copied into (``dist.all_to_all_single(out,
    inp, ...)`` traces to ``out.copy_(wait(all_to_all_single(inp, ...)))``), and reads its input and split
    sizes from its placeholders (the first one is the ``ctx`` where the body has one more placeholder than
    operands). None: not such an op, or no all-to-all in its forward; a str: why an all-to-all in its forward
    is not understood.
    """
    if not is_function_apply(n):
        return None
    body = _body(n, 0)
    if body is None:
        return None
    a2as = [m for m in body.graph.nodes if is_call(m, *ALL_TO_ALL)]
    if not a2as:
        return None
    where = f"the autograd.Function {n.name} (autograd_function_apply)"
    if len(a2as) > 1:
        return f"{where} runs {len(a2as)} all-to-alls in its forward; one is understood"
    (a2a,) = a2as
    placeholders = body.graph.find_nodes(op="placeholder")
    operands = n.args[2:]
    skip = len(placeholders) - len(operands)
    if skip not in (0, 1):
        return f"{where} has {len(placeholders)} forward placeholders for {len(operands)} operands"
    outer = {p: operands[i - skip] for i, p in enumerate(placeholders) if i >= skip}

    def lift(v: object) -> object:
        while is_method_call(v, "contiguous"):
            v = v.args[0]
        if isinstance(v, fx.Node):
            if v not in outer:
                raise LookupError(v.name)
            return outer[v]
        return v

    (out,) = body.graph.find_nodes(op="output")
    first = out.args[0]
    while isinstance(first, (tuple, list)) and first:
        first = first[0]
    if first is not wait_end(a2a):
        return f"{where} returns {getattr(first, 'name', first)}, not the result of its all-to-all {a2a.name}"
    a = AllToAllArgs(arg(a2a, 0, "input"), as_list(arg(a2a, 1, "output_split_sizes")),
                     as_list(arg(a2a, 2, "input_split_sizes")), arg(a2a, 3, "group_name"))
    try:
        return AllToAllArgs(lift(a.input), [lift(s) for s in a.output_split_sizes],
                            [lift(s) for s in a.input_split_sizes], a.group_name)
    except LookupError as e:
        return (f"{where} computes {e} inside its forward and passes it to its all-to-all {a2a.name}; only "
                "values it takes as inputs are understood")


def wait_end(n: fx.Node) -> fx.Node:
    """Follow the wait chain of a collective to the node whose value the program reads.

    ``wait_tensor`` users (torchtitan waits twice on its counts), torch 2.11's
    ``autograd_function_apply(..., a2a, ...)`` followed by ``getitem(., 0)``, ``getitem(., 0)`` of a user
    ``autograd.Function`` that is an all-to-all (``function_all_to_all``), and the fresh buffer the result is
    copied into (an in-place ``dist.all_to_all_single(out, ...)``: ``out.copy_(wait(...))``).
    """
    if isinstance(function_all_to_all(n), AllToAllArgs):
        firsts = [g for g in n.users if is_call(g, operator.getitem) and g.args[1] == 0]
        return firsts[0] if len(firsts) == 1 else n
    while True:
        waits = [u for u in n.users if is_call(u, *WAIT)]
        if len(waits) == 1:
            n = waits[0]
            continue
        applies = [u for u in n.users if is_function_apply(u)]
        if len(applies) == 1:
            firsts = [g for g in applies[0].users if is_call(g, operator.getitem) and g.args[1] == 0]
            if len(firsts) == 1:
                n = firsts[0]
                continue
        copies = [u for u in n.users if is_method_call(u, "copy_") and u.args[1] is n and is_fresh(u.args[0])]
        buffer = copies[0].args[0] if len(copies) == 1 else n
        assert isinstance(buffer, fx.Node)  # is_fresh holds only for nodes
        return buffer


def _walk_up(
    roots: Iterable[object], stop: Callable[[fx.Node], bool],
    written: Callable[[fx.Node], fx.Node | None] = lambda m: None,
) -> tuple[set[fx.Node], set[fx.Node]]:
    """``(visited, stopped)``: nodes reached walking up from ``roots`` without passing a ``stop`` node, and the
    ``stop`` nodes met (not walked through); ``written(m)``: a value written into ``m`` in place, walked too."""
    visited: set[fx.Node] = set()
    stopped: set[fx.Node] = set()
    stack = flat_nodes(roots)
    while stack:
        m = stack.pop()
        if m in visited or m in stopped:
            continue
        if stop(m):
            stopped.add(m)
            continue
        visited.add(m)
        stack.extend(m.all_input_nodes)
        source = written(m)
        if source is not None:
            stack.append(source)
    return visited, stopped


def ancestors(roots: Iterable[object]) -> set[fx.Node]:
    """Every node some root reads, transitively (roots included)."""
    return _walk_up(roots, lambda m: False)[0]


def upstream_collectives(roots: Iterable[object]) -> set[fx.Node]:
    """The collectives (all-to-all, all-gather; not waits) met first walking up from ``roots``, also through
    what a ``buffer.copy_(src)`` wrote into a buffer (an in-place ``dist.all_to_all_single(out, ...)``)."""
    return _walk_up(roots, lambda m: is_all_to_all(m) or is_call(m, *ALL_GATHER), _written_by_copy)[1]


def closest(candidates: set[fx.Node]) -> set[fx.Node]:
    """The candidates that are not upstream of another candidate."""
    if len(candidates) < 2:
        return candidates
    return {c for c in candidates if not any(c in ancestors(o.all_input_nodes) for o in candidates - {c})}

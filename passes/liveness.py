"""liveness: which nodes of a Dynamo graph die when a region's output is replaced.

The matcher uses ``dead_after_replacing`` to decide a region's ``nodes`` (what the rewrite erases) before
anything is mutated, and refuses a region whose all-to-alls would survive; the rewrite uses
``erase_unused_pure`` afterwards for pure values that only dying nodes read.

Dynamo's runtime checks of ``.item()`` values (``_assert_scalar`` on SymInt comparisons) read the region's
SymInts without being part of its dataflow: they form *assert cones* that die with the region.
"""

from __future__ import annotations

import torch.fx as fx

from relay_compile.passes.fx_nodes import is_assert, is_mutator
from relay_compile.passes.roles import is_symbolic_arith


def _unread(n: fx.Node, weak: set[fx.Node]) -> bool:
    """A pure value that nothing live reads: dead code, which Dynamo leaves in higher-order op bodies (an unused
    ``recv.size()`` of a checkpointed block) though it removes it from the top graph."""
    return (n.op in ("call_function", "call_method") and all(u in weak for u in n.users) and not n.is_impure()
            and not is_mutator(n) and not is_assert(n))


def assert_cones(graph: fx.Graph) -> set[fx.Node]:
    """Asserts with no users, and the pure SymInt arithmetic only they read (Dynamo's runtime checks); pure
    values nothing else reads (dead code) too: they die with any input, as an assert cone does."""
    weak: set[fx.Node] = set()
    for n in reversed(graph.nodes):
        if (is_assert(n) and not n.users or n.users and all(u in weak for u in n.users) and is_symbolic_arith(n)
                or _unread(n, weak)):
            weak.add(n)
    return weak


def dead_after_replacing(
    output: fx.Node, pinned: set[fx.Node], weak: set[fx.Node], aliases: tuple[fx.Node, ...] = ()
) -> set[fx.Node]:
    """The nodes that die once ``output`` (and its ``aliases``: a buffer an in-place ``output`` wrote) have no
    users (they included).

    A node dies when it has a dead user and every other user is dead, in an assert cone (``weak``), or an
    in-place write into it with no users. A node of an assert cone dies with any dead input or with all its
    users; an in-place write with no users dies with what it writes. Pinned nodes (the ring's inputs) and
    placeholders never die; other side effects (buffer updates, grad-mode toggles) are kept.
    """
    dead = {output, *aliases}
    todo = [i for n in dead for i in n.all_input_nodes]
    while todo:
        n = todo.pop()
        if n in dead or n in pinned or n.op in ("placeholder", "output"):
            continue
        if n in weak:
            dies = any(a in dead for a in n.all_input_nodes) or bool(n.users) and all(u in dead for u in n.users)
        elif not n.users:
            dies = is_mutator(n) and n.args[0] in dead
        else:
            dies = any(u in dead for u in n.users) and all(
                u in dead or u in weak or (not u.users and is_mutator(u) and u.args[0] is n) for u in n.users
            )
        if dies:
            dead.add(n)
            todo.extend(n.all_input_nodes)
            todo.extend(u for u in n.users if u not in dead)
    return dead


def erase_unused_pure(candidates: set[fx.Node]) -> None:
    """Dead-code elimination limited to ``candidates`` and what they read: pure nodes left without users."""
    todo = list(candidates)
    while todo:
        n = todo.pop()
        if n.users or n.op not in ("call_function", "call_method") or n.is_impure() or is_mutator(n):
            continue
        todo.extend(n.all_input_nodes)
        n.graph.erase_node(n)

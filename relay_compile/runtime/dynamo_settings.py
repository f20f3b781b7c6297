"""dynamo_settings: what Dynamo must capture for an MoE region to reach the backend whole, set only while a
model compiled with ``backend="relaymoe"`` runs (docs/ARCHITECTURE.md section 5, "Dynamo and split sizes").

An all-to-all dispatcher reads its split sizes on the host (``.tolist()``) and often computes data-dependent
shapes (``repeat_interleave`` of counts, ``nonzero``, boolean masks). With Dynamo's defaults each of these
breaks the graph, so no graph holds a dispatch and its combine. ``DYNAMO_SETTINGS`` keeps them in the graph
(unbacked SymInts); ``dynamo_settings()`` is the backend's ``backend_ctx_ctor``: Dynamo enters it around
every call of a frame compiled with the backend (tracing included) and restores the previous values after.

Contract:
    Code compiled with any other backend, or run eagerly, sees Dynamo's config unchanged. Inside a call of a
    relaymoe-compiled model the two settings are on for every frame Dynamo traces, including functions it
    inlines and frames after a graph break.
    ``torch.compile`` wraps every backend but inductor in ``torch._TorchCompileWrapper``, whose attributes do
    not include the backend's ``backend_ctx_ctor`` (torch 2.0 - 2.13; ``torch._dynamo.optimize`` honours it):
    ``keep_backend_ctx_through_torch_compile`` makes Dynamo find it through the wrapper. It changes nothing
    for backends without that attribute (none of torch's own has one).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._dynamo import eval_frame

from relay_compile.runtime.grouped_linear import grouped_linears_seen_through

log = logging.getLogger(__name__)

# Dynamo config values the backend runs under (and nothing else): split sizes read on the host become
# unbacked SymInts, and ops whose output shape depends on data stay in the graph.
DYNAMO_SETTINGS: dict[str, bool] = {"capture_scalar_outputs": True, "capture_dynamic_output_shape_ops": True}


@dataclass(frozen=True)
class NonEmptyBranch:
    """A Python branch on a data-dependent size that the backend decided as if the size were not empty."""

    condition: str  # the SymBool, e.g. "Eq(u2 + u3, 0)"
    taken: bool
    where: str  # the user's file:line


# What ``non_empty_branches`` decided, in order (the report and the tests read it; reset per Dynamo reset).
NON_EMPTY_BRANCHES: list[NonEmptyBranch] = []


def _user_line() -> str:
    stack = torch._guards.TracingContext.extract_stack()
    return f"{stack[-1].filename}:{stack[-1].lineno}" if stack else "<unknown>"


def _is_empty_test(condition: torch.SymBool) -> bool | None:
    """For ``size == 0`` (``size != 0``), ``size`` a sum of unbacked SymInts, what the branch takes if the size
    is not empty: False (True); None for any other condition."""
    import sympy
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    expr = condition.node.expr
    if not isinstance(expr, (sympy.Eq, sympy.Ne)):
        return None
    sides = [a for a in expr.args if a != 0]
    if len(sides) != 1 or len(expr.args) != 2:
        return None
    terms = sides[0].args if sides[0].is_Add else (sides[0],)
    if not all(t.is_Symbol for t in terms) or not free_unbacked_symbols(sides[0]):
        return None
    return isinstance(expr, sympy.Ne)


@contextlib.contextmanager
def non_empty_branches() -> Iterator[None]:
    """Dynamo decides a branch on whether a data-dependent size is empty, ``if tokens.shape[0] == 0:`` on the
    rows an all-to-all received (a sum of unbacked SymInts ``== 0`` or ``!= 0``), as if the size were not
    empty, instead of breaking the graph there; any other branch Dynamo cannot decide still breaks it.

    Why it is needed: that branch, inside a context manager as in transformers' ``AllToAllEP.__call__``
    (under ``_use_local_dtensor_params``), makes Dynamo give up on the whole frame, and the block's two
    all-to-alls land in different graphs. What it changes: the compiled graph always runs the general path,
    also for an empty receive. That is right where the general path computes the empty case as the special
    one does (an empty receive through the experts gives an empty output; transformers' empty branch exists
    only to keep FSDP's backward connected, which the general path does too), and it is what the upstream
    form of such code, ``if guard_or_false(tokens.shape[0] == 0):``, compiles to. Each decision is logged
    and recorded in ``NON_EMPTY_BRANCHES`` with the user's file:line.
    """
    from torch._dynamo.variables.tensor import SymNodeVariable
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    original = SymNodeVariable.evaluate_expr

    def evaluate_expr(self: Any, output_graph: Any = None) -> Any:
        try:
            return original(self, output_graph)
        except torch._dynamo.exc.UserError as e:
            cause = e.__cause__ or e.__context__
            taken = _is_empty_test(self.sym_num) if isinstance(self.sym_num, torch.SymBool) else None
            if not isinstance(cause, GuardOnDataDependentSymNode) or taken is None:
                raise
        decision = NonEmptyBranch(condition=str(self.sym_num), taken=taken, where=_user_line())
        NON_EMPTY_BRANCHES.append(decision)
        log.info("relaymoe: Dynamo's branch on %s at %s takes %s (the data-dependent size taken as not empty)",
                 decision.condition, decision.where, decision.taken)
        return taken

    SymNodeVariable.evaluate_expr = evaluate_expr  # type: ignore[method-assign]
    try:
        yield
    finally:
        SymNodeVariable.evaluate_expr = original  # type: ignore[method-assign]


# Logging calls Dynamo runs after the graph instead of breaking it there (its own setting, the set torch.export
# uses): a warning or a print inside an MoE block, on one rank or all, would otherwise split the block. What it
# changes: the message is emitted when the graph has run, so a tensor it formats shows its value at the end of
# the graph (a tensor mutated after the call prints mutated); a call with other arguments than tensors, constants
# and format strings (a size, a SymInt) still breaks the graph.
LOGGING_FUNCTIONS = frozenset({
    print, warnings.warn, logging.debug, logging.info, logging.warning, logging.error, logging.critical,
    logging.exception, logging.log,
})


@contextlib.contextmanager
def dynamo_settings() -> Iterator[None]:
    """A fresh context that sets ``DYNAMO_SETTINGS``, adds ``LOGGING_FUNCTIONS`` to Dynamo's reorderable ones,
    enters ``non_empty_branches`` and ``grouped_linear.grouped_linears_seen_through`` (Transformer Engine's
    GroupedLinear traceable); restores the previous values on exit."""
    logging_functions = set(torch._dynamo.config.reorderable_logging_functions) | LOGGING_FUNCTIONS
    with torch._dynamo.config.patch(**DYNAMO_SETTINGS, reorderable_logging_functions=logging_functions), \
            non_empty_branches(), grouped_linears_seen_through():
        yield


def _ctx_of_wrapped(backend: object) -> Callable[[], contextlib.AbstractContextManager[Any]] | None:
    """The ``backend_ctx_ctor`` of the compiler fn inside ``torch.compile``'s wrapper ``backend``, if any."""
    inner = getattr(backend, "compiler_fn", None)  # torch._TorchCompileWrapper.compiler_fn (and its debug copy)
    return getattr(inner, "backend_ctx_ctor", None)


def keep_backend_ctx_through_torch_compile() -> None:
    """Make ``torch.compile(fn, backend=b)`` enter ``b.backend_ctx_ctor`` as ``torch._dynamo.optimize(b)`` does.

    Wraps ``torch._dynamo.eval_frame.get_compiler_fn`` (called by ``optimize`` / ``optimize_assert`` just
    before they read ``backend_ctx_ctor``) so the debug wrapper it returns carries the attribute of the
    backend torch.compile wrapped. Idempotent.
    """
    original = eval_frame.get_compiler_fn
    if getattr(original, "_relaymoe_keeps_backend_ctx", False):
        return

    def get_compiler_fn(compiler_fn: Any) -> Any:
        wrapped = original(compiler_fn)
        ctor = _ctx_of_wrapped(compiler_fn)
        if ctor is not None and not hasattr(wrapped, "backend_ctx_ctor"):
            wrapped.backend_ctx_ctor = ctor
        return wrapped

    get_compiler_fn._relaymoe_keeps_backend_ctx = True  # type: ignore[attr-defined]
    eval_frame.get_compiler_fn = get_compiler_fn  # type: ignore[assignment]

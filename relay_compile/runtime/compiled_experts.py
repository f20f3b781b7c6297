"""compiled_experts: an F the recognizer refused, run per hop as code the inner compiler compiled.

    compile_expert_fn(eager, inner_compiler, probes, weights, tol) -> CompiledExpertFn   (raises if it cannot)

Contract:
    Consumes a region's F as ``RegionExpertFn`` (``expert_fn``) and the backend's inner compiler
    (``"inductor"`` or ``"aot_eager"``). Returns the ring's ``ExpertFn`` with a fused backward
    (``experts.ExpertVJP``): ``__call__`` is F's forward and ``vjp`` F's recompute and vector-Jacobian product
    in one graph, each compiled by ``torch.compile(backend=inner_compiler, fullgraph=True)``, so a hop runs
    two compiled graphs and no autograd over F's ops. The rows dimension of every row tensor is unbacked
    (``mark_unbacked``) and F's split sizes enter as one int64 host tensor read inside the graph
    (``.tolist()``: unbacked SymInts, as in the Dynamo graph F was cut from), so hops of any size, 0 and 1
    rows included, and any source run the graphs compiled for the first one: each compiles once per dtype,
    device and F. Compiled once per F identity (``RegionExpertFn`` equality), whatever the number of
    regions, recompiles and rings sharing it. Raises when F cannot be compiled whole or the compiled graphs
    differ from F on the probe inputs beyond ``tol``; the caller then runs F eagerly and says why. A call
    that fails later (a new dtype that does not compile) logs a warning and runs F eagerly from then on.

Pseudo-code:
    # Step 1: a copy of each entry point with a code object of its own (Dynamo's cache is per code object).
    # Step 2: torch.compile each (fullgraph, the inner compiler; Dynamo settings of the backend).
    # Step 3: run forward and vjp on the probes; compare with F and autograd over F.

Legend: S rows, H hidden, N ranks, E_l experts per rank.
"""

from __future__ import annotations

import hashlib
import logging
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from relay_compile.runtime.dynamo_settings import dynamo_settings
from relay_compile.runtime.region_fn import RegionExpertFn

log = logging.getLogger(__name__)

# The inner compilers that compile F (the backend's "eager" runs F as it is).
COMPILERS = ("inductor", "aot_eager")
# Probe inputs: ``(x_SH, counts_NL, splits_N)`` of one call of F.
Probe = tuple[Tensor, Tensor, list[int]]
# Pull-back score in fp32, as ``hop_compute`` reduces ``d_score``.
ACC_DTYPE = torch.float32


def _forward(eager: RegionExpertFn, x_SH: Tensor, counts_NL: Tensor, splits_S: Tensor,
             weights: Sequence[Tensor]) -> Tensor:
    """F, with its split sizes read from a host tensor (traced: unbacked SymInts, never specialized)."""
    return eager.fn(*eager.arguments(x_SH, counts_NL, _sizes(splits_S), weights))


def _vjp(eager: RegionExpertFn, x_SH: Tensor, counts_NL: Tensor, splits_S: Tensor, weights: Sequence[Tensor],
         dy_SH: Tensor, score_S: Tensor) -> tuple[Tensor, Tensor, list[Tensor]]:
    """``experts.ExpertVJP`` of F: recompute, then pull ``dy * score`` back; ``d_score = <dy, out>`` in fp32."""
    sizes = _sizes(splits_S)

    def f(x: Tensor, *w: Tensor) -> Tensor:
        return eager.fn(*eager.arguments(x, counts_NL, sizes, w))

    result = torch.func.vjp(f, x_SH, *weights)  # (out, pull-back): typed as the has_aux triple
    out_SH, pull = result[0], result[1]
    d_score_S = (dy_SH.to(ACC_DTYPE) * out_SH.to(ACC_DTYPE)).sum(-1)
    grads = pull(dy_SH * score_S[:, None].to(dy_SH.dtype))
    return grads[0], d_score_S, list(grads[1:])


def _sizes(splits_S: Tensor) -> list[Any]:
    sizes = splits_S.tolist()
    for s in sizes:
        torch._check(s >= 0)  # split sizes are sizes (as Dynamo's checks of the .item() values F was cut with)
    return sizes


def _own_code(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """Step 1: ``fn`` with a code object of its own: Dynamo keeps compiled graphs (and counts recompiles) per
    code object, so two F compiled from one shared function would evict each other's graphs."""
    assert isinstance(fn, types.FunctionType)
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__,
                              fn.__closure__)


def _unbacked_rows(*tensors: Tensor) -> None:
    """Rows of any count, 0 and 1 included, run one graph (no 0/1 specialization, no duck sizing)."""
    for t in tensors:
        torch._dynamo.decorators.mark_unbacked(t, 0)


class _Differentiable(torch.autograd.Function):
    """The compiled forward under autograd (scores before F, or ``remat=False``: the ring records F with
    autograd), differentiated by the compiled vjp (score 1)."""

    @staticmethod
    def forward(ctx: Any, fn: CompiledExpertFn, x_SH: Tensor, counts_NL: Tensor, splits_S: Tensor,
                *weights: Tensor) -> Tensor:
        ctx.fn = fn
        ctx.save_for_backward(x_SH, counts_NL, splits_S, *weights)
        # Detached: the compiled graphs are guarded on requires_grad, and these run without autograd.
        return fn.forward(x_SH.detach(), counts_NL, splits_S, [w.detach() for w in weights])

    @staticmethod
    def backward(ctx: Any, dy_SH: Tensor) -> tuple[Tensor | None, ...]:
        x_SH, counts_NL, splits_S, *weights = (t.detach() for t in ctx.saved_tensors)
        ones_S = dy_SH.new_ones(dy_SH.shape[0], dtype=ACC_DTYPE)
        dx_SH, _, d_weights = ctx.fn.pull_back(x_SH, counts_NL, splits_S, weights, dy_SH, ones_S)
        return None, dx_SH, None, None, *d_weights


class CompiledExpertFn:
    """The ring's ``ExpertFn`` (with ``vjp``) over a region's F compiled by ``inner_compiler`` (see the module
    docstring). Equal when their F is equal and compiled by the same compiler."""

    def __init__(self, eager: RegionExpertFn, inner_compiler: str) -> None:
        if inner_compiler not in COMPILERS:
            raise ValueError(f"compiled_experts: inner compiler {inner_compiler!r} does not compile; use one of "
                             f"{COMPILERS}")
        self.eager, self.inner_compiler = eager, inner_compiler
        self._identity = (eager, inner_compiler)
        self.__qualname__ = f"CompiledExpertFn[{inner_compiler},{self.digest()}]"
        # Step 2: one compiled forward and one compiled vjp per F.
        name = f"{inner_compiler}_{eager.digest()}"
        self._forward = torch.compile(_own_code(_forward, f"expert_forward_{name}"), backend=inner_compiler,
                                      fullgraph=True)
        self._vjp = torch.compile(_own_code(_vjp, f"expert_vjp_{name}"), backend=inner_compiler, fullgraph=True)
        # Why the compiled graphs stopped being used (None: they are used).
        self.failure: str | None = None

    def digest(self) -> str:
        return hashlib.sha256(repr(("compiled", self.inner_compiler, self.eager.digest())).encode()).hexdigest()[:12]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CompiledExpertFn) and other._identity == self._identity

    def __hash__(self) -> int:
        return hash(self._identity)

    def _splits(self, counts_NL: Tensor, splits_N: list[int]) -> Tensor:
        return torch.tensor(self.eager.split_values(counts_NL, splits_N), dtype=torch.int64)

    def _fail(self, e: Exception) -> None:
        self.failure = f"{type(e).__name__}: {e}"
        log.warning("compiled_experts: %s runs eagerly from now on: the compiled F failed: %s", self.__qualname__,
                    self.failure, exc_info=log.isEnabledFor(logging.DEBUG))

    def forward(self, x_SH: Tensor, counts_NL: Tensor, splits_S: Tensor, weights: Sequence[Tensor]) -> Tensor:
        """The compiled forward (no autograd state)."""
        _unbacked_rows(x_SH)
        with dynamo_settings(), torch.no_grad():
            return self._forward(self.eager, x_SH, counts_NL, splits_S, list(weights))

    def pull_back(self, x_SH: Tensor, counts_NL: Tensor, splits_S: Tensor, weights: Sequence[Tensor],
                  dy_SH: Tensor, score_S: Tensor) -> tuple[Tensor, Tensor, list[Tensor]]:
        """The compiled vjp."""
        _unbacked_rows(x_SH, dy_SH, score_S)
        with dynamo_settings(), torch.no_grad():
            return self._vjp(self.eager, x_SH, counts_NL, splits_S, list(weights), dy_SH, score_S)

    def __call__(self, x_SH: Tensor, counts_NL: Tensor, splits_N: list[int], weights: Sequence[Tensor]) -> Tensor:
        if self.failure is None:
            splits_S = self._splits(counts_NL, splits_N)
            try:
                if torch.is_grad_enabled() and any(t.requires_grad for t in (x_SH, *weights)):
                    return _Differentiable.apply(self, x_SH, counts_NL, splits_S, *weights)
                return self.forward(x_SH, counts_NL, splits_S, weights)
            except Exception as e:  # noqa: BLE001 -- any failure of the compiled F: F itself computes the same
                self._fail(e)
        return self.eager(x_SH, counts_NL, splits_N, weights)

    def vjp(self, x_SH: Tensor, counts_NL: Tensor, splits_N: list[int], weights: Sequence[Tensor], dy_SH: Tensor,
            score_S: Tensor) -> tuple[Tensor, Tensor, list[Tensor]]:
        """``experts.ExpertVJP``: ``(dx (S, H), d_score (S,) fp32, d_weights like the weights)``."""
        if self.failure is None:
            try:
                return self.pull_back(x_SH, counts_NL, self._splits(counts_NL, splits_N), weights, dy_SH, score_S)
            except Exception as e:  # noqa: BLE001 -- as in __call__
                self._fail(e)
        return _eager_vjp(self.eager, x_SH, counts_NL, splits_N, weights, dy_SH, score_S)


def _eager_vjp(eager: RegionExpertFn, x_SH: Tensor, counts_NL: Tensor, splits_N: list[int],
               weights: Sequence[Tensor], dy_SH: Tensor, score_S: Tensor) -> tuple[Tensor, Tensor, list[Tensor]]:
    """What ``vjp`` computes, by autograd over F (the fallback, and the probe's truth)."""
    x = x_SH.detach().requires_grad_()
    w = [t.detach().requires_grad_() for t in weights]
    with torch.enable_grad():
        out_SH = eager(x, counts_NL, splits_N, w)
        d_score_S = (dy_SH.to(ACC_DTYPE) * out_SH.detach().to(ACC_DTYPE)).sum(-1)
        grads = torch.autograd.grad(out_SH, [x, *w], dy_SH * score_S[:, None].to(dy_SH.dtype), allow_unused=True)
    dx_SH, *d_weights = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, [x, *w])]
    return dx_SH, d_score_S, d_weights


def _max_error(got: Sequence[Tensor], want: Sequence[Tensor]) -> float:
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        if w.numel():
            scale = w.float().abs().max().clamp_min(1e-12)
            worst = max(worst, ((g.float() - w.float()).abs().max() / scale).item())
    return worst


# Compiled F by (F, inner compiler): one compilation per F identity, across regions, graphs and explain.
_COMPILED: dict[tuple[RegionExpertFn, str], CompiledExpertFn] = {}


def compile_expert_fn(eager: RegionExpertFn, inner_compiler: str, probes: Sequence[Probe],
                      weights: Sequence[Tensor], tol: float) -> CompiledExpertFn:
    """F compiled by ``inner_compiler`` and proven on ``probes`` against F and autograd over F (module docstring).

    Raises:
        ValueError: ``inner_compiler`` does not compile, or a compiled result differs from F's by more than
            ``tol`` (max relative difference).
        Exception: whatever compiling F raised (Dynamo, aot_autograd, the inner compiler).
    """
    key = (eager, inner_compiler)
    compiled = _COMPILED.get(key)
    if compiled is not None:
        return compiled
    compiled = CompiledExpertFn(eager, inner_compiler)
    gen = torch.Generator().manual_seed(20261202)
    # Step 3: both entry points on every probe, against F.
    for x_SH, counts_NL, splits_N in probes:
        splits_S = compiled._splits(counts_NL, splits_N)
        with torch.no_grad():
            want = eager(x_SH, counts_NL, splits_N, weights)
        got = compiled.forward(x_SH, counts_NL, splits_S, weights)
        dy_SH = torch.randn(want.shape, generator=gen).to(want.device, want.dtype)
        score_S = torch.rand(x_SH.shape[0], generator=gen).to(x_SH.device)
        want_dx, want_ds, want_dw = _eager_vjp(eager, x_SH, counts_NL, splits_N, weights, dy_SH, score_S)
        got_dx, got_ds, got_dw = compiled.pull_back(x_SH, counts_NL, splits_S, weights, dy_SH, score_S)
        error = _max_error([got, got_dx, got_ds, *got_dw], [want, want_dx, want_ds, *want_dw])
        if not error <= tol:
            raise ValueError(f"compiled_experts: F compiled by {inner_compiler} differs from F by {error:.2e} on "
                             f"{x_SH.shape[0]} probe rows")
    _COMPILED[key] = compiled
    return compiled

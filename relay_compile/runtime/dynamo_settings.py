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
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo import eval_frame

# Dynamo config values the backend runs under (and nothing else): split sizes read on the host become
# unbacked SymInts, and ops whose output shape depends on data stay in the graph.
DYNAMO_SETTINGS: dict[str, bool] = {"capture_scalar_outputs": True, "capture_dynamic_output_shape_ops": True}


def dynamo_settings() -> contextlib.AbstractContextManager[None]:
    """A fresh context that sets ``DYNAMO_SETTINGS`` and restores the previous values on exit."""
    return torch._dynamo.config.patch(**DYNAMO_SETTINGS)


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

"""grouped_linear: Transformer Engine's ``GroupedLinear`` seen through while Dynamo traces the backend's frames.

Most Megatron-core MoE runs build their experts with TE (``TEGroupedMLP``: ``linear_fc1``/``linear_fc2`` are
``transformer_engine.pytorch.GroupedLinear``, per-expert weights ``weight0..N-1`` of shape (out, in),
``forward(inp, m_splits)``). TE wraps that forward in ``torch._dynamo.disable``, so Dynamo breaks the graph between
an MoE block's two all-to-alls and no region can be rewritten. While Dynamo traces a frame compiled with the
backend (``dynamo_settings``), ``grouped_linears_seen_through`` gives each such class a forward Dynamo can trace:
what the module computes, per split ``x_i @ W_i^T (+ b_i)``, written in torch ops on the module's own
parameters (read in place), so the block is one graph and ``passes.expert_block`` lowers the experts onto the
ring's grouped GEMMs like any per-expert ``nn.Linear``. Outside the backend's frames, and in a frame the backend
compiles where the module runs eagerly, TE's forward runs as before.

Seen through only where the ring computes what TE would (``unsupported`` names what it does not honour; the
module then keeps TE's forward, Dynamo breaks the graph there, and the refusal names the reason):
FP8 (a recipe whose scaling state the ring would bypass: ``fp8`` is a ring option of its own), weight-gradient
fusion into ``main_grad`` (``fuse_wgrad_accumulation``), delayed weight gradients (``delay_wgrad_compute``), a
single grouped weight or bias, tensor-parallel experts (``parallel_mode``, ``sequence_parallel`` with a TP group
larger than one), TE's debug features, and ``out``/``dgrad_out``/``is_first_microbatch`` arguments.

A region the backend refuses runs its seen-through ``GroupedLinear`` calls as those torch ops (same math, not
TE's kernels). Classes: TE's, when ``transformer_engine`` is already imported (this module never imports it: TE
loads cuDNN at import), and any registered with ``register_grouped_linear`` (a module of the same interface: the
CPU tests' stand-in).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as nnf
from torch import Tensor, nn

log = logging.getLogger(__name__)

__all__ = ["UNSEEN", "grouped_linears_seen_through", "register_grouped_linear", "unsupported"]

# (module path, class name) of Transformer Engine's GroupedLinear (2.x).
TE_GROUPED_LINEAR = ("transformer_engine.pytorch.module.grouped_linear", "GroupedLinear")
_REGISTERED: list[type[nn.Module]] = []
# What kept a GroupedLinear on TE's forward in a traced frame: "<class> <reason>" (refusals name it).
UNSEEN: list[str] = []
_WRAPPERS: dict[Any, Any] = {}  # TE's forward -> its seen-through forward


def register_grouped_linear(cls: type[nn.Module]) -> None:
    """See ``cls`` through as TE's ``GroupedLinear`` (same interface: ``num_gemms``, ``weight{i}``/``bias{i}``,
    ``use_bias``, ``return_bias``, ``forward(inp, m_splits)``). Idempotent."""
    if cls not in _REGISTERED:
        _REGISTERED.append(cls)


def _classes() -> list[type[nn.Module]]:
    module = sys.modules.get(TE_GROUPED_LINEAR[0])
    te = getattr(module, TE_GROUPED_LINEAR[1], None) if module is not None else None
    return [*_REGISTERED, *([te] if isinstance(te, type) and te not in _REGISTERED else [])]


def _fp8_manager() -> Any:
    """TE's ``FP8GlobalStateManager`` where TE is imported (looked up outside Dynamo's tracing), else None."""
    for name in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        manager = getattr(sys.modules.get(name), "FP8GlobalStateManager", None)
        if manager is not None:
            return manager
    return None


def unsupported(module: nn.Module, fp8_manager: Any = None) -> str:
    """Why the ring cannot compute what ``module`` (a GroupedLinear) computes; "" where it can. Plain attribute
    reads: Dynamo traces them as constants of the module (and guards on them)."""
    wgrad_store = getattr(module, "wgrad_store", None)
    flags = {
        # TE's FP8 recipes keep per-module scaling state (amax histories, scales) the ring would bypass; the
        # ring's own FP8 hops are an option of theirs, taken outside fp8_autocast.
        "fp8 (Transformer Engine's fp8_autocast or the module's FP8; for FP8 hops on the ring compile with "
        "options={'fp8': True} outside fp8_autocast)":
            bool(getattr(module, "fp8", False)) or bool(fp8_manager is not None and fp8_manager.is_fp8_enabled()),
        "fuse_wgrad_accumulation": bool(getattr(module, "fuse_wgrad_accumulation", False)),
        "delay_wgrad_compute": bool(wgrad_store is not None and wgrad_store.delay_wgrad_compute()),
        "single_grouped_weight": bool(getattr(module, "single_grouped_weight", False)),
        "single_grouped_bias": bool(getattr(module, "single_grouped_bias", False)),
        "tensor-parallel experts (tp_size > 1)": int(getattr(module, "tp_size", 1) or 1) > 1,
    }
    on = [name for name, value in flags.items() if value]
    return f"runs with {', '.join(on)}, which the ring does not honour" if on else ""


@torch._dynamo.assume_constant_result
def _record_unseen(cls_name: str, why: str) -> str:
    """At trace time (Dynamo runs it for its constant result): record and log why a GroupedLinear keeps TE's
    forward."""
    UNSEEN.append(f"{cls_name} {why}")
    log.warning("relaymoe: %s %s: it keeps Transformer Engine's forward, and Dynamo breaks the graph there",
                cls_name, why)
    return why


def traced_forward(module: nn.Module, inp: Tensor, m_splits: Tensor | list[int]) -> Any:
    """What ``GroupedLinear.forward(inp, m_splits)`` computes, in torch ops Dynamo traces: rows split by
    ``m_splits``, split ``i`` through ``linear(x_i, weight{i}, bias{i})`` in the weights' dtype."""
    splits = m_splits.tolist() if isinstance(m_splits, Tensor) else list(m_splits)
    weights = [getattr(module, f"weight{i}") for i in range(module.num_gemms)]
    use_bias, return_bias = bool(getattr(module, "use_bias", False)), bool(getattr(module, "return_bias", False))
    biases = [getattr(module, f"bias{i}") for i in range(module.num_gemms)] if use_bias else [None] * len(weights)
    x = inp.to(weights[0].dtype)
    out = torch.cat([nnf.linear(x_i, w, None if return_bias else b)
                     for x_i, w, b in zip(torch.split(x, splits), weights, biases, strict=True)])
    if return_bias:
        return out, [b.to(weights[0].dtype) for b in biases if b is not None]
    return out


def _seen_through(original: Any, fp8_manager: Any) -> Any:
    """``original`` (a GroupedLinear forward) as Dynamo traces it in the backend's frames (module docstring)."""

    def forward(self: nn.Module, inp: Tensor, m_splits: Any, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            return original(self, inp, m_splits, *args, **kwargs)
        why = unsupported(self, fp8_manager)
        if not why and (args or any(v is not None for v in kwargs.values())):
            why = "is called with more than (inp, m_splits)"
        if why:
            _record_unseen(type(self).__name__, why)
            return original(self, inp, m_splits, *args, **kwargs)
        return traced_forward(self, inp, m_splits)

    forward.__wrapped__ = original  # type: ignore[attr-defined]
    forward._relaymoe_seen_through = True  # type: ignore[attr-defined]
    return forward


@contextlib.contextmanager
def grouped_linears_seen_through() -> Iterator[None]:
    """Each GroupedLinear class's forward traceable by Dynamo while the context is on (module docstring)."""
    originals = {cls: cls.forward for cls in _classes() if not getattr(cls.forward, "_relaymoe_seen_through", False)}
    fp8_manager = _fp8_manager()
    for cls, original in originals.items():
        # One wrapper per original for the process: Dynamo's guards see the same function at every call.
        if original not in _WRAPPERS:
            _WRAPPERS[original] = _seen_through(original, fp8_manager)
        cls.forward = _WRAPPERS[original]  # type: ignore[method-assign]
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.forward = original  # type: ignore[method-assign]

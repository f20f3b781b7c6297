"""expert_lowering: run a recognized F on the engine's grouped experts, after proving it on probe inputs.

    choose_expert_fn(region, inner_compiler) -> (ExpertFn, ExpertsPath)

1. ``expert_block.recognize_expert_ffn`` reads F's per-row program (activation, projections, layouts).
2. ``LoweredFFN`` (``runtime.lowered_ffn``, what runs in every hop) is that program as the engine's grouped
   experts, on the region's weights packed into the engine's layout.
3. The probe: on small inputs drawn from a fixed seed (rows of one source, an empty expert among the counts,
   the region's weight shapes and dtypes, on the weights' device), ``LoweredFFN`` and F itself
   (``RegionExpertFn``) must agree to the dtype's rounding. This proves what the structural step does not:
   that F's row moves (permute, split, unpermute) put each row back in place and group rows by the right
   expert. Every rank probes the same F with the same inputs, so every rank decides the same.

When any step fails, F is compiled by the backend's inner compiler (``runtime.compiled_experts``: its forward and
vjp per hop), proven on the same probe inputs; when that fails too (or the inner compiler is ``"eager"``), F runs
eagerly per hop (``RegionExpertFn``), and ``ExpertsPath.reason`` says why.

Legend (docs/ARCHITECTURE.md): S rows, H hidden, F expert FFN width, N ranks, E_l experts per rank, U = 2F.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import Tensor

from relay_compile.passes.expert_block import recognize_expert_ffn
from relay_compile.passes.ffn_template import NotAnFFN
from relay_compile.passes.fx_nodes import node_value, size_hint
from relay_compile.passes.refusals import Refusal
from relay_compile.passes.region import Region
from relay_compile.runtime.compiled_experts import COMPILERS, CompiledExpertFn, compile_expert_fn
from relay_compile.runtime.lowered_ffn import LoweredFFN
from relay_compile.runtime.region_fn import ExpertFnBinding, RegionExpertFn

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ExpertsPath:
    """How a region's experts run at each hop: ``"grouped"`` (recognized, on grouped GEMMs), ``"compiled
    (<inner compiler>)"`` (F compiled, ``runtime.compiled_experts``) or ``"eager"`` (F itself)."""

    kind: str
    description: str  # what was recognized, or what was compiled (and why it was not lowered); "" for eager
    reason: str = ""  # eager: why neither grouped nor compiled

    def summary(self) -> str:
        return f"{self.kind}: {self.description or self.reason}"


def tolerance(*dtypes: torch.dtype | None) -> float:
    low = any(d in (torch.bfloat16, torch.float16) for d in dtypes)
    return 3e-2 if low else 1e-5


def _hint(size: int | torch.SymInt) -> int:
    """``fx_nodes.size_hint``, which a probe input cannot do without."""
    hint = size_hint(size)
    if hint is None:
        raise ValueError(f"size {size} has no hint (data-dependent)")
    return hint


# The capacity a probe receive has where the region's C has no hint.
_PROBE_CAPACITY = 3


def _probe_weight(like: Tensor, gen: torch.Generator) -> Tensor:
    """A random weight shaped like ``like``, scaled so activations stay O(1)."""
    w = torch.randn(tuple(_hint(d) for d in like.shape), generator=gen) / max(1, _hint(like.shape[-1])) ** 0.5
    return w.to(device=like.device, dtype=like.dtype)


def probe_inputs(
    rows_like: Tensor, weights_like: Sequence[Tensor], group_size: int, experts_per_rank: int
) -> tuple[list[tuple[Tensor, Tensor, list[int]]], list[Tensor]]:
    """``([(x_SH, counts_NL, splits_N), ...], weights)``: F's probe inputs (see the module docstring), from a
    fixed seed: rows of source 0 and of source N-1, each with an empty expert among the counts.

    ``rows_like``/``weights_like``: (fake) tensors with the dtypes, devices and weight shapes of the region.
    """
    device, hidden = weights_like[0].device, _hint(rows_like.shape[-1])
    gen = torch.Generator().manual_seed(20261201)
    e_l, n = experts_per_rank, group_size
    weights = [_probe_weight(w, gen) for w in weights_like]
    probes = []
    for src in sorted({0, n - 1}):
        rows_L = [1 + (3 * e + 2 + src) % 5 for e in range(e_l)]
        if e_l > 1:
            rows_L[e_l // 2] = 0  # an expert without rows (never all of them: rows must exist to compare)
        counts_NL = torch.zeros(n, e_l, dtype=torch.int64)
        counts_NL[src] = torch.tensor(rows_L)
        splits_N = [0] * n
        splits_N[src] = sum(rows_L)
        x_SH = torch.randn(sum(rows_L), hidden, generator=gen).to(device=device, dtype=rows_like.dtype)
        probes.append((x_SH, counts_NL.to(device), splits_N))
    return probes, weights


def probe_error(
    eager: RegionExpertFn, lowered: LoweredFFN, rows_like: Tensor, weights_like: Sequence[Tensor], group_size: int
) -> float:
    """Max relative difference of ``lowered`` and F (``eager``) on the probe inputs (``probe_inputs``)."""
    probes, weights = probe_inputs(rows_like, weights_like, group_size, lowered.experts_per_rank)
    worst = 0.0
    for x_SH, counts_NL, splits_N in probes:
        with torch.no_grad():
            want = eager(x_SH, counts_NL, splits_N, weights).float()
            got = lowered(x_SH, counts_NL, splits_N, weights).float()
        scale = want.abs().max().clamp_min(1e-12)
        worst = max(worst, ((got - want).abs().max() / scale).item())
    return worst


def capacity_probe_error(
    fn: fx.GraphModule, binding: ExpertFnBinding, lowered: LoweredFFN, recv_like: Tensor,
    weights_like: Sequence[Tensor], group_size: int,
) -> float:
    """Max relative difference of ``lowered`` and a capacity region's F on one random receive.

    F reads the receive ``(N * E_l, C, H)`` (rows source-major, then local expert, then slot) and returns the
    combine's input in the same order; ``lowered`` gets the rows grouped by expert (``(E_l, N, C)`` order).
    """
    device, e_l, n = weights_like[0].device, lowered.experts_per_rank, group_size
    gen = torch.Generator().manual_seed(20261201)
    weights = [_probe_weight(w, gen) for w in weights_like]
    # C may be data-dependent (DeepSpeed's drop_tokens=False reads it from a tensor): any C proves the lowering.
    sizes = [_hint(d) if i != 1 or size_hint(d) is not None else _PROBE_CAPACITY for i, d in enumerate(recv_like.shape)]
    recv = torch.randn(sizes, generator=gen).to(device, recv_like.dtype)
    hidden = recv.shape[-1]
    args: list[object] = [None] * len(fn.graph.find_nodes(op="placeholder"))
    args[binding.rows] = recv
    for pos, w in zip(binding.weights, weights):
        args[pos] = w
    x_LNCH = recv.reshape(n, e_l, -1, hidden).transpose(0, 1)
    rows = x_LNCH.shape[1] * x_LNCH.shape[2]
    rows_L = torch.full((e_l,), rows, dtype=torch.int64)
    with torch.no_grad():
        want = fn(*args).float().reshape(n, e_l, -1, hidden)
        got_SH = lowered.forward_rows(x_LNCH.reshape(-1, hidden), torch.cumsum(rows_L, 0, dtype=torch.int32).to(
            device), rows_L.tolist(), lowered.pack(weights))
    got = got_SH.float().reshape(e_l, n, -1, hidden).transpose(0, 1)
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def recognized_ffn(region: Region) -> bool:
    """Whether ``region``'s F is recognized as an FFN, which ``choose_expert_fn`` lowers onto grouped experts
    unless its probe disagrees: the decisions made before the rewrite (``rewrite.kept_at_compile_time``, the
    token switch, the report) predict the ring with grouped owners per hop only then. No probe, no compile."""
    try:
        recognize_expert_ffn(region.expert_fn, region.binding, region.experts_per_rank)
    except NotAnFFN:
        return False
    return True


def choose_expert_fn(
    region: Region, inner_compiler: str = "eager"
) -> tuple[RegionExpertFn | LoweredFFN | CompiledExpertFn, ExpertsPath]:
    """The expert function a region's ring runs, and the path it takes (see the module docstring).

    ``inner_compiler``: the backend's; an F that is not lowered is compiled by it (``runtime.compiled_experts``)
    unless it is ``"eager"`` or compiling fails, and then runs eagerly. An F that reads a capacity receive
    (``region.experts_input == "capacity"``) runs only lowered: where lowering or its proof fails, raises
    ``Refusal`` (nothing of the graph has changed yet: the caller leaves the region as it is).
    """
    eager = RegionExpertFn(region.expert_fn, region.binding)
    try:
        plan = recognize_expert_ffn(region.expert_fn, region.binding, region.experts_per_rank)
    except NotAnFFN as e:
        return _not_lowered(region, eager, inner_compiler, f"F is not recognized: {e}")
    lowered = LoweredFFN(plan, region.experts_per_rank, eager.digest())
    rows_like, weights_like = node_value(region.recv), [node_value(w) for w in region.weights]
    try:
        error = _PROBES[region.experts_input](region, eager, lowered, rows_like, weights_like)
    except Exception as e:  # F or the lowering cannot run on probe inputs: keep F (compiling it would not run)
        log.debug("expert_lowering: probe of %s failed", region.describe(), exc_info=True)
        return _eager(region, eager, f"the probe could not run: {e!r}")
    if not error <= tolerance(rows_like.dtype, plan.compute_dtype, *(w.dtype for w in weights_like)):
        return _not_lowered(
            region, eager, inner_compiler,
            f"recognized as {plan.describe()}, but it differs from F on probe inputs by {error:.2e}",
        )
    return lowered, ExpertsPath(kind="grouped", description=plan.describe())


def _rows_probe(region: Region, eager: RegionExpertFn, lowered: LoweredFFN, rows_like: Tensor,
                weights_like: Sequence[Tensor]) -> float:
    return probe_error(eager, lowered, rows_like, weights_like, region.group_size)


def _capacity_probe(region: Region, eager: RegionExpertFn, lowered: LoweredFFN, rows_like: Tensor,
                    weights_like: Sequence[Tensor]) -> float:
    return capacity_probe_error(region.expert_fn, region.binding, lowered, rows_like, weights_like,
                                region.group_size)


# How F is proven against its lowering, by what F reads (``region.ExpertsInput``).
_PROBES = {"rows": _rows_probe, "capacity": _capacity_probe}


def _not_lowered(
    region: Region, eager: RegionExpertFn, inner_compiler: str, why: str
) -> tuple[RegionExpertFn | CompiledExpertFn, ExpertsPath]:
    """F compiled by the inner compiler (``runtime.compiled_experts``), or else F itself (``_eager``); ``why``: why
    it is not lowered. An F that runs only lowered is refused at once (``_eager``), not compiled."""
    if region.experts_input == "capacity":
        return _eager(region, eager, why)
    if inner_compiler not in COMPILERS:
        return _eager(region, eager, f"{why}; inner_compiler={inner_compiler!r}")
    rows_like, weights_like = node_value(region.recv), [node_value(w) for w in region.weights]
    try:
        probes, weights = probe_inputs(rows_like, weights_like, region.group_size, region.experts_per_rank)
        compiled = compile_expert_fn(eager, inner_compiler, probes, weights,
                                     tolerance(rows_like.dtype, *(w.dtype for w in weights_like)))
    except Exception as e:  # noqa: BLE001 -- any failure to compile F: F itself still runs
        log.warning("expert_lowering: %s: F runs eagerly, compiling it with %s failed: %r", region.describe(),
                    inner_compiler, e, exc_info=log.isEnabledFor(logging.DEBUG))
        return _eager(region, eager, f"{why}; compiling it with {inner_compiler} failed: {e!r}")
    return compiled, ExpertsPath(kind=f"compiled ({inner_compiler})",
                                 description=f"forward and vjp per hop, rows dynamic ({why})")


def _eager(region: Region, eager: RegionExpertFn, reason: str) -> tuple[RegionExpertFn, ExpertsPath]:
    """F itself, run per hop; raises ``Refusal`` for an F that runs only lowered (a capacity receive)."""
    if region.experts_input == "capacity":
        raise Refusal(region.dispatch, f"the capacity experts do not run as grouped experts ({reason}); F's "
                                       "shapes are the whole receive's, so the ring runs capacity experts only "
                                       "lowered")
    return eager, ExpertsPath(kind="eager", description="", reason=reason)

"""expert_lowering: run a recognized F on the engine's grouped experts, after proving it on probe inputs.

    choose_expert_fn(region, inner_compiler) -> (ExpertFn, ExpertsPath)

1. ``expert_block.recognize_expert_ffn`` reads F's per-row program (activation, projections, layouts).
2. ``LoweredFFN`` is that program as a ``GroupedExperts`` (``relay_compile.experts``): the region's weights are
   packed once per step into the engine's layout (``[w13 (E_l, 2F, H), w2 (E_l, H, F)]`` for gated
   activations, ``[w1, w2]`` otherwise, then the biases F adds: ``b13 (E_l, 2F)`` or ``b1 (E_l, F)``, and
   ``b2 (E_l, H)``; a view where the layout already is the engine's, one copy otherwise),
   circulate packed, run as grouped GEMMs per chunk with the fused SwiGLU backward where it applies, and their
   gradients are unpacked to the region's layout at the end of the step.
3. The probe: on small inputs drawn from a fixed seed (rows of one source, an empty expert among the counts,
   the region's weight shapes and dtypes, on the weights' device), ``LoweredFFN`` and F itself
   (``RegionExpertFn``) must agree to the dtype's rounding. This proves what the structural step does not:
   that F's row moves (permute, split, unpermute) put each row back in place and group rows by the right
   expert. Every rank probes the same F with the same inputs, so every rank decides the same.

When any step fails, F is compiled by the backend's inner compiler (``expert_compile``: its forward and vjp
per hop), proven on the same probe inputs; when that fails too (or the inner compiler is ``"eager"``), F runs
eagerly per hop (``RegionExpertFn``), and ``ExpertsPath.reason`` says why.

Legend: S rows, H hidden, F expert FFN width, N ranks, E_l experts per rank, G = 2F.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import Tensor

from relay_compile.experts import GradSink, GroupedFFN
from relay_compile.passes.expert_block import recognize_expert_ffn
from relay_compile.passes.expert_compile import COMPILERS, CompiledExpertFn, compile_expert_fn
from relay_compile.passes.expert_fn import ExpertFnBinding, RegionExpertFn
from relay_compile.passes.ffn_template import BiasRole, ExpertFFN, NotAnFFN, WeightRole
from relay_compile.passes.fx_nodes import node_value, size_hint
from relay_compile.passes.refusals import Refusal
from relay_compile.passes.region import Region

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ExpertsPath:
    """How a region's experts run at each hop: ``"grouped"`` (recognized, on grouped GEMMs), ``"compiled
    (<inner compiler>)"`` (F compiled, ``expert_compile``) or ``"eager"`` (F itself)."""

    kind: str
    description: str  # what was recognized, or what was compiled (and why it was not lowered); "" for eager
    reason: str = ""  # eager: why neither grouped nor compiled

    def summary(self) -> str:
        return f"{self.kind}: {self.description or self.reason}"


# ----------------------------------------------------------------------------------------------------------
# Weights between the region's layout and the engine's
# ----------------------------------------------------------------------------------------------------------


def _expert_matrix(weights: Sequence[Tensor], role: WeightRole, e: int) -> Tensor:
    position, index = role.per_expert[e]
    w = weights[position] if index is None else weights[position][index]
    return w if role.layout == "out_in" else w.t()


def _canonical(weights: Sequence[Tensor], role: WeightRole, experts: int) -> Tensor:
    """The role's weights as ``(E_l, out, in)`` (a view for a stacked out-in weight)."""
    if role.stacked is not None:
        w = weights[role.stacked]
        return w if role.layout == "out_in" else w.transpose(-2, -1)
    return torch.stack([_expert_matrix(weights, role, e) for e in range(experts)])


def _owned(g: Tensor, dtype: torch.dtype) -> Tensor:
    """``g`` in ``dtype``, contiguous, and not a view: custom-op outputs must not alias each other."""
    if g.dtype != dtype:
        return g.to(dtype, memory_format=torch.contiguous_format)
    return g.clone(memory_format=torch.contiguous_format) if g._base is not None else g.contiguous()


def _scatter_grad(grads: list[Tensor | None], weights: Sequence[Tensor], role: WeightRole, g_LOI: Tensor) -> None:
    """Write the role's gradient ``(E_l, out, in)`` into ``grads`` in the region's layout and dtypes."""
    if role.stacked is not None:
        g = g_LOI if role.layout == "out_in" else g_LOI.transpose(-2, -1)
        grads[role.stacked] = _owned(g, weights[role.stacked].dtype)
        return
    for e, (position, index) in enumerate(role.per_expert):
        g = g_LOI[e] if role.layout == "out_in" else g_LOI[e].t()
        if index is None:
            grads[position] = _owned(g, weights[position].dtype)
            continue
        whole = grads[position]
        if whole is None:
            whole = grads[position] = torch.zeros_like(weights[position])
        whole[index] += g.to(whole.dtype)


def _expert_bias(weights: Sequence[Tensor], role: BiasRole, e: int) -> Tensor:
    position, index = role.per_expert[e]
    return (weights[position] if index is None else weights[position][index]).reshape(-1)


def _canonical_bias(weights: Sequence[Tensor], role: BiasRole, experts: int) -> Tensor:
    """The role's biases as ``(E_l, out)`` (a view of a stacked ``(E_l, out)`` or ``(E_l, 1, out)`` bias)."""
    if role.stacked is not None:
        return weights[role.stacked].reshape(experts, -1)
    return torch.stack([_expert_bias(weights, role, e) for e in range(experts)])


def _scatter_bias_grad(grads: list[Tensor | None], weights: Sequence[Tensor], role: BiasRole, g_LO: Tensor) -> None:
    """Write the role's bias gradient ``(E_l, out)`` into ``grads`` in the region's shapes and dtypes."""
    if role.stacked is not None:
        grads[role.stacked] = _owned(g_LO.reshape(weights[role.stacked].shape), weights[role.stacked].dtype)
        return
    for e, (position, index) in enumerate(role.per_expert):
        if index is None:
            grads[position] = _owned(g_LO[e].reshape(weights[position].shape), weights[position].dtype)
            continue
        whole = grads[position]
        if whole is None:
            whole = grads[position] = torch.zeros_like(weights[position])
        whole[index] += g_LO[e].reshape(whole[index].shape).to(whole.dtype)


class LoweredFFN:
    """A recognized F as the ring's expert function (``ExpertFn`` and ``GroupedExperts``).

    Args:
        plan: what F computes per row (``ffn_template.ExpertFFN``).
        experts_per_rank: E_l.
        identity: the F it stands for (``RegionExpertFn.digest()``), part of its equality and its spec key.
    """

    def __init__(self, plan: ExpertFFN, experts_per_rank: int, identity: str) -> None:
        self.plan, self.experts_per_rank, self._identity = plan, experts_per_rank, identity
        # Packed biases: the first projection's (gate, or gate and up: b13, zeros for a half without one), down's.
        first_bias = plan.gate_bias is not None or plan.up_bias is not None
        self.inner = GroupedFFN(plan.activation, biases=(first_bias, plan.down_bias is not None))
        # With casts too (F computes in compute_dtype): the packed weights are in it, the rows are cast per chunk.
        self.has_fused_backward = self.inner.has_fused_backward
        self.__qualname__ = f"LoweredFFN[{plan.activation},{self.digest()}]"

    def digest(self) -> str:
        return hashlib.sha256(repr((self._identity, self.plan)).encode()).hexdigest()[:12]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoweredFFN) and (other._identity, other.plan) == (self._identity, self.plan)

    def __hash__(self) -> int:
        return hash((self._identity, self.plan))

    # --- GroupedExperts: packing ---

    def num_packed(self, num_weights: int) -> int:
        return 2 + sum(self.inner.biases)

    def pack(self, weights: Sequence[Tensor]) -> list[Tensor]:
        plan, experts = self.plan, self.experts_per_rank
        gate = _canonical(weights, plan.gate, experts)
        if plan.up is not None:
            gate = torch.cat([gate, _canonical(weights, plan.up, experts)], dim=1)
        down = _canonical(weights, plan.down, experts)
        dtype = plan.compute_dtype or weights[0].dtype
        packed = [gate, down, *self._pack_biases(weights, gate.shape[1], down.shape[1])]
        return [w.to(dtype, memory_format=torch.contiguous_format) for w in packed]

    def _pack_biases(self, weights: Sequence[Tensor], first_out: int, down_out: int) -> list[Tensor]:
        """``[b13 or b1, b2]``, those F has: ``(E_l, 2F)`` or ``(E_l, F)``, ``(E_l, H)``; a gated projection
        pair with one bias gets zeros for the other half (never read back: its gradient is dropped)."""
        plan, experts = self.plan, self.experts_per_rank
        packed = []
        if self.inner.biases[0]:
            halves = [plan.gate_bias, plan.up_bias] if plan.up is not None else [plan.gate_bias]
            out = first_out // len(halves)
            like = weights[0]
            packed.append(torch.cat([
                _canonical_bias(weights, b, experts) if b is not None else like.new_zeros(experts, out)
                for b in halves], dim=1))
        if plan.down_bias is not None:
            packed.append(_canonical_bias(weights, plan.down_bias, experts))
            assert packed[-1].shape[1] == down_out, "LoweredFFN: the down bias does not match the down projection"
        return packed

    def unpack_grads(self, grads: Sequence[Tensor], weights: Sequence[Tensor]) -> list[Tensor]:
        plan = self.plan
        d_gate, d_down, *d_biases = grads
        out: list[Tensor | None] = [None] * len(weights)
        ffn = d_down.shape[-1]
        self._unpack_bias_grads(out, weights, d_biases, ffn)
        if plan.up is not None:
            _scatter_grad(out, weights, plan.up, d_gate[:, ffn:])
            d_gate = d_gate[:, :ffn]
        _scatter_grad(out, weights, plan.gate, d_gate)
        _scatter_grad(out, weights, plan.down, d_down)
        assert all(g is not None for g in out), "LoweredFFN: a weight got no gradient"
        return [g for g in out if g is not None]

    def _unpack_bias_grads(
        self, out: list[Tensor | None], weights: Sequence[Tensor], d_biases: Sequence[Tensor], ffn: int
    ) -> None:
        """The packed bias gradients ``[db13 or db1, db2]`` (those there are) into ``out``, in F's layout; the
        gradient of a zero half (a gated pair with one bias) is dropped."""
        plan, rest = self.plan, iter(d_biases)
        if self.inner.biases[0]:
            d_first = next(rest)
            halves = [(plan.gate_bias, d_first)] if plan.up is None else [
                (plan.gate_bias, d_first[:, :ffn]), (plan.up_bias, d_first[:, ffn:])]
            for role, g in halves:
                if role is not None:
                    _scatter_bias_grad(out, weights, role, g)
        if plan.down_bias is not None:
            _scatter_bias_grad(out, weights, plan.down_bias, next(rest))

    # --- GroupedExperts: entry points ---

    def _compute(self, x: Tensor) -> Tensor:
        dtype = self.plan.compute_dtype
        return x if dtype is None else x.to(dtype)

    def forward_rows(
        self, x_SH: Tensor, offsets_G: Tensor, rows_G: Sequence[int], weights: Sequence[Tensor]
    ) -> Tensor:
        return self.inner.forward_rows(self._compute(x_SH), offsets_G, rows_G, weights).to(x_SH.dtype)

    def vjp_rows(
        self, x_TH: Tensor, tok_S: Tensor | None, offsets_G: Tensor, rows_G: Sequence[int],
        weights: Sequence[Tensor], dy_TH: Tensor, score_S: Tensor, grad_dtype: torch.dtype | None = None,
        grad_into: GradSink | None = None, d_score_out: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, list[Tensor]]:
        """The fused backward; where F computes in another dtype than the rows' (torchtitan: bf16 GEMMs on fp32
        parameters and rows), on this chunk's rows cast to it and the packed weights (cast once per step, by
        ``pack``), as autograd through F's casts would: ``dy`` rounded to the GEMMs' dtype, ``dx`` cast back to
        the rows' dtype. Weight gradients stay in the GEMMs' dtype (or ``grad_dtype``) while they sum over chunks
        and hops, and ``unpack_grads`` casts them to the parameters' dtype once per step.
        """
        assert self.has_fused_backward, f"{self.__qualname__}: no fused backward"
        dtype = self.plan.compute_dtype
        if dtype is None or dtype == x_TH.dtype == dy_TH.dtype:
            return self.inner.vjp_rows(x_TH, tok_S, offsets_G, rows_G, weights, dy_TH, score_S, grad_dtype, grad_into,
                                       d_score_out)
        # Gathered, then cast: the chunk's rows only, never a cast copy of all T rows per chunk.
        x_SH = (x_TH if tok_S is None else x_TH[tok_S]).to(dtype)
        dy_SH = (dy_TH if tok_S is None else dy_TH[tok_S]).to(dtype)
        dx_SH, d_score_S, dws = self.inner.vjp_rows(x_SH, None, offsets_G, rows_G, weights, dy_SH, score_S,
                                                    grad_dtype, grad_into, d_score_out)
        return dx_SH.to(x_TH.dtype), d_score_S, dws

    # --- ExpertFn (the probe, and callers without grouped entry points) ---

    def __call__(self, x_SH: Tensor, counts_NL: Tensor, splits_N: list[int], weights: Sequence[Tensor]) -> Tensor:
        counts_L = counts_NL.sum(0)
        offsets_L = torch.cumsum(counts_L, 0, dtype=torch.int32)
        return self.forward_rows(x_SH, offsets_L, counts_L.tolist(), self.pack(weights))


# ----------------------------------------------------------------------------------------------------------
# The probe
# ----------------------------------------------------------------------------------------------------------


def tolerance(*dtypes: torch.dtype | None) -> float:
    low = any(d in (torch.bfloat16, torch.float16) for d in dtypes)
    return 3e-2 if low else 1e-5


def _hint(size: int | torch.SymInt) -> int:
    """``fx_nodes.size_hint``, which a probe input cannot do without."""
    hint = size_hint(size)
    if hint is None:
        raise ValueError(f"size {size} has no hint (data-dependent)")
    return hint


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
    recv = torch.randn(tuple(_hint(d) for d in recv_like.shape), generator=gen).to(device, recv_like.dtype)
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


def choose_expert_fn(
    region: Region, inner_compiler: str = "eager"
) -> tuple[RegionExpertFn | LoweredFFN | CompiledExpertFn, ExpertsPath]:
    """The expert function a region's ring runs, and the path it takes (see the module docstring).

    ``inner_compiler``: the backend's; an F that is not lowered is compiled by it (``expert_compile``) unless
    it is ``"eager"`` or compiling fails, and then runs eagerly. An F that reads a capacity receive
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
    except Exception as e:  # F or the lowering cannot run on probe inputs: keep F
        log.debug("expert_lowering: probe of %s failed", region.describe(), exc_info=True)
        return _not_lowered(region, eager, "eager", f"the probe could not run: {e!r}")
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
    """F compiled by the inner compiler (``expert_compile``), or else F itself; ``why``: why it is not lowered.
    Raises ``Refusal`` for an F that runs only lowered (a capacity receive)."""
    if region.experts_input == "capacity":
        raise Refusal(region.dispatch, f"the capacity experts do not run as grouped experts ({why}); F's shapes "
                                       "are the whole receive's, so the ring runs capacity experts only lowered")
    if inner_compiler not in COMPILERS:
        return eager, ExpertsPath(kind="eager", description="", reason=f"{why}; inner_compiler={inner_compiler!r}")
    rows_like, weights_like = node_value(region.recv), [node_value(w) for w in region.weights]
    try:
        probes, weights = probe_inputs(rows_like, weights_like, region.group_size, region.experts_per_rank)
        compiled = compile_expert_fn(eager, inner_compiler, probes, weights,
                                     tolerance(rows_like.dtype, *(w.dtype for w in weights_like)))
    except Exception as e:  # noqa: BLE001 -- any failure to compile F: F itself still runs
        log.warning("expert_lowering: %s: F runs eagerly, compiling it with %s failed: %r", region.describe(),
                    inner_compiler, e, exc_info=log.isEnabledFor(logging.DEBUG))
        return eager, ExpertsPath(kind="eager", description="",
                                  reason=f"{why}; compiling it with {inner_compiler} failed: {e!r}")
    return compiled, ExpertsPath(kind=f"compiled ({inner_compiler})",
                                 description=f"forward and vjp per hop, rows dynamic ({why})")

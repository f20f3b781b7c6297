"""lowered_ffn: a region's F, recognized as an FFN of experts, run by the ring as grouped experts.

``LoweredFFN`` is the recognized program (``ffn_plan.ExpertFFN``) as a ``GroupedExperts``
(``relay_compile.experts``): the region's weights are packed once per step into the engine's layout
(``[w13 (E_l, 2F, H), w2 (E_l, H, F)]`` for gated activations, ``[w1, w2]`` otherwise, then the biases F adds:
``b13 (E_l, 2F)`` or ``b1 (E_l, F)``, and ``b2 (E_l, H)``; a view where the layout already is the engine's, one
copy otherwise), circulate packed, run as grouped GEMMs per chunk with the fused SwiGLU backward where it
applies, and their gradients are unpacked to the region's layout at the end of the step. What makes one and
proves it against F is the passes' (``passes.expert_lowering``); this is what runs in every hop.

Legend (docs/ARCHITECTURE.md): S rows, H hidden, F expert FFN width, N ranks, E_l experts per rank, U = 2F.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import Tensor

from relay_compile.experts import GradSink, GroupedFFN
from relay_compile.grouped_gemm import Rows, SumTarget, gathered
from relay_compile.runtime.ffn_plan import BiasRole, ExpertFFN, WeightRole

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

    def _compute(self, x: Rows) -> Rows:
        """``x`` in F's compute dtype (rows read at their indices stay so where no cast is needed)."""
        dtype = self.plan.compute_dtype
        if dtype is None or dtype == x.dtype:
            return x
        return gathered(x).to(dtype)

    def _uncast(self, x_TH: Tensor) -> bool:
        dtype = self.plan.compute_dtype
        return dtype is None or dtype == x_TH.dtype

    def reads_at_indices(self, x_TH: Tensor, weights: Sequence[Tensor]) -> bool:
        """``GroupedFFN.reads_at_indices`` where F computes in the rows' dtype (a cast needs the gathered rows)."""
        return self._uncast(x_TH) and self.inner.reads_at_indices(x_TH, weights)

    def adds_in_gemm(self, x_TH: Tensor, weights: Sequence[Tensor]) -> bool:
        """``GroupedFFN.adds_in_gemm`` where F computes in the rows' dtype (else its output is cast back first; a
        backward whose ``dy`` is in another dtype adds ``dx`` after its cast)."""
        return self._uncast(x_TH) and self.inner.adds_in_gemm(x_TH, weights)

    def projection_dtype(self, weights: Sequence[Tensor]) -> torch.dtype:
        """``GroupedFFN.projection_dtype``: the packed weights' dtype (F's compute dtype where it casts)."""
        return self.plan.compute_dtype or weights[0].dtype

    def forward_rows(
        self, x_SH: Rows, offsets_G: Tensor, rows_G: Sequence[int], weights: Sequence[Tensor],
        save_into: Tensor | None = None, add_into: SumTarget | None = None,
    ) -> Tensor | None:
        if add_into is not None:  # only where adds_in_gemm: no cast
            return self.inner.forward_rows(x_SH, offsets_G, rows_G, weights, save_into, add_into)
        out = self.inner.forward_rows(self._compute(x_SH), offsets_G, rows_G, weights, save_into)
        assert out is not None
        return out.to(x_SH.dtype)

    def vjp_rows(
        self, x_TH: Tensor, tok_S: Tensor | None, offsets_G: Tensor, rows_G: Sequence[int],
        weights: Sequence[Tensor], dy_TH: Tensor, score_S: Tensor, grad_dtype: torch.dtype | None = None,
        grad_into: GradSink | None = None, d_score_out: Tensor | None = None, projections: Tensor | None = None,
        projections_writable: bool = False, dx_into: SumTarget | None = None, activation_in_gemm: bool = False,
    ) -> tuple[Tensor | None, Tensor, list[Tensor]]:
        """The fused backward; where F computes in another dtype than the rows' (torchtitan: bf16 GEMMs on fp32
        parameters and rows), on this chunk's rows cast to it and the packed weights (cast once per step, by
        ``pack``), as autograd through F's casts would: ``dy`` rounded to the GEMMs' dtype, ``dx`` cast back to
        the rows' dtype. Weight gradients stay in the GEMMs' dtype (or ``grad_dtype``) while they sum over chunks
        and hops, and ``unpack_grads`` casts them to the parameters' dtype once per step. ``projections``,
        ``projections_writable``, ``activation_in_gemm``: as ``GroupedFFN.vjp_rows`` (the last only where F computes
        in the rows' dtype: ``reads_at_indices``).
        """
        assert self.has_fused_backward, f"{self.__qualname__}: no fused backward"
        dtype = self.plan.compute_dtype
        if dtype is None or dtype == x_TH.dtype == dy_TH.dtype:
            return self.inner.vjp_rows(x_TH, tok_S, offsets_G, rows_G, weights, dy_TH, score_S, grad_dtype, grad_into,
                                       d_score_out, projections=projections,
                                       projections_writable=projections_writable, dx_into=dx_into,
                                       activation_in_gemm=activation_in_gemm)
        # Gathered, then cast: the chunk's rows only, never a cast copy of all T rows per chunk.
        x_SH = (x_TH if tok_S is None else torch.index_select(x_TH, 0, tok_S)).to(dtype)
        dy_SH = (dy_TH if tok_S is None else torch.index_select(dy_TH, 0, tok_S)).to(dtype)
        dx_SH, d_score_S, dws = self.inner.vjp_rows(x_SH, None, offsets_G, rows_G, weights, dy_SH, score_S,
                                                    grad_dtype, grad_into, d_score_out, projections=projections,
                                                    projections_writable=projections_writable)
        assert dx_SH is not None
        if dx_into is not None:  # the rows cast back, then added (the GEMM cannot add what F's cast rounds)
            dx_into.add_rows(dx_SH.to(x_TH.dtype))
            return None, d_score_S, dws
        return dx_SH.to(x_TH.dtype), d_score_S, dws

    # --- ExpertFn (the probe, and callers without grouped entry points) ---

    def __call__(self, x_SH: Tensor, counts_NL: Tensor, splits_N: list[int], weights: Sequence[Tensor]) -> Tensor:
        counts_L = counts_NL.sum(0)
        offsets_L = torch.cumsum(counts_L, 0, dtype=torch.int32)
        return self.forward_rows(x_SH, offsets_L, counts_L.tolist(), self.pack(weights))


# ----------------------------------------------------------------------------------------------------------
# The probe
# ----------------------------------------------------------------------------------------------------------

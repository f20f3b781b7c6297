"""Numerics of a MoE block in low precision: each leaf's error against an fp32 truth.

    truth = leaf_values(a2a_moe, inputs.to(torch.float32), grad_y)      # the same inputs, fp32 GEMMs and sums
    errors = relative_errors(leaf_values(ring_moe, inputs, grad_y), truth)

A leaf is one of ``LEAVES``: the output and every gradient the block returns. Its error is
``max |got - truth| / max |truth|`` over this rank's elements: a scale-free number that a bf16 rounding of the
largest element puts at about 2**-9 = 2e-3, and a sum of roundings grows. The truth runs the all-to-all layer
(``reference.a2a_moe``: one GEMM per expert over all its rows, fp32 accumulation) in fp32 on the bf16 inputs
cast up, so it differs from the exact math only by fp32 roundings (~1e-7).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from relay_compile import ring_moe
from relay_compile.bench.configs import LayerConfig
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group
from relay_compile.reference import a2a_moe

# The output, then the gradients: inputs, scores, and the expert weights in the order the block takes them.
LEAVES = ("y", "dx", "d_scores", "d_w1", "d_w2", "d_w3")

Block = Callable[..., Tensor]


@dataclass(frozen=True, kw_only=True)
class BlockInputs:
    """One rank's inputs of a block call: tokens, routing, expert weights and the output's gradient."""

    x_TH: Tensor
    topk_ids_TK: Tensor
    topk_scores_TK: Tensor
    weights: Sequence[Tensor]
    grad_y_TH: Tensor

    def to(self, dtype: torch.dtype) -> BlockInputs:
        """The same values in ``dtype`` (ids unchanged)."""
        return BlockInputs(
            x_TH=self.x_TH.to(dtype), topk_ids_TK=self.topk_ids_TK, topk_scores_TK=self.topk_scores_TK.to(dtype),
            weights=[w.to(dtype) for w in self.weights], grad_y_TH=self.grad_y_TH.to(dtype),
        )


def leaf_values(block: Block, inputs: BlockInputs, **kw: object) -> dict[str, Tensor]:
    """``block(x, ids, scores, *weights, **kw)`` forward and backward: ``{leaf: value}``."""
    x = inputs.x_TH.detach().clone().requires_grad_()
    scores = inputs.topk_scores_TK.detach().clone().requires_grad_()
    weights = [w.detach().clone().requires_grad_() for w in inputs.weights]
    y = block(x, inputs.topk_ids_TK, scores, *weights, **kw)
    y.backward(inputs.grad_y_TH)
    grads = [x.grad, scores.grad, *(w.grad for w in weights)]
    assert all(g is not None for g in grads), "numerics: the block left a leaf without a gradient"
    return dict(zip(LEAVES, [y.detach(), *grads], strict=False))


def relative_errors(got: dict[str, Tensor], truth: dict[str, Tensor]) -> dict[str, float]:
    """Per leaf, ``max |got - truth| / max |truth|``, then per leaf (``"<leaf> rms"``) the root-mean-square error
    over the truth's (in fp32; the error itself where the truth is all zeros). The max is one element's luck
    within a rounding; the rms says whether a path is worse throughout."""
    errors, rms = {}, {}
    for leaf, want in truth.items():
        diff, want = got[leaf].float() - want.float(), want.float()
        errors[leaf] = _ratio(diff.abs().max().item(), want.abs().max().item())
        rms[f"{leaf} rms"] = _ratio(diff.square().mean().sqrt().item(), want.square().mean().sqrt().item())
    return errors | rms


def _ratio(err: float, scale: float) -> float:
    return err / scale if scale > 0 else err


def block_errors(
    blocks: dict[str, tuple[Block, dict[str, object]]], inputs: BlockInputs, truth_block: Block,
    truth_kw: dict[str, object] | None = None,
) -> dict[str, dict[str, float]]:
    """``{row: {leaf: error}}`` for each ``row: (block, kwargs)`` on ``inputs``, against ``truth_block`` in fp32.

    Collective blocks: every rank calls this with the same rows in the same order.
    """
    truth = leaf_values(truth_block, inputs.to(torch.float32), **(truth_kw or {}))
    return {row: relative_errors(leaf_values(block, inputs, **kw), truth) for row, (block, kw) in blocks.items()}


def max_over_ranks(errors: dict[str, dict[str, float]], group: dist.ProcessGroup | None) -> dict[str, dict[str, float]]:
    """The largest error of each (row, leaf) over the ranks of ``group`` (None: this rank's own)."""
    if group is None:
        return errors
    keys = [(row, leaf) for row, by_leaf in errors.items() for leaf in by_leaf]
    flat = torch.tensor([errors[row][leaf] for row, leaf in keys], dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    out: dict[str, dict[str, float]] = {row: {} for row in errors}
    for (row, leaf), value in zip(keys, flat.tolist(), strict=True):
        out[row][leaf] = value
    return out


def errors_table(errors: dict[str, dict[str, float]], baseline: str) -> str:
    """Markdown: one column per row of ``errors``, one line per leaf, each ring column also as a ratio to
    ``baseline``'s error."""
    rows = list(errors)
    head = "| leaf | " + " | ".join(rows) + " |"
    lines = [head, "|---|" + "---:|" * len(rows)]
    for leaf in errors[baseline]:
        base = errors[baseline][leaf]
        cells = [
            f"{errors[row][leaf]:.2e}" + ("" if row == baseline or base == 0 else f" ({errors[row][leaf] / base:.2f}x)")
            for row in rows
        ]
        lines.append(f"| {leaf} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@dataclass(kw_only=True)
class NumericsResult:
    """One configuration's leaf errors: ``errors[row][leaf]``, against ``truth`` (how the truth was made)."""

    label: str
    truth: str
    errors: dict[str, dict[str, float]]


# The rows of a layer's numerics: what stand-in EP computes exactly (expert routing; token routing's stand-in
# revisits this rank's own tokens, a different function: ``bench.standin_group``).
NUMERICS_ROWS: dict[str, tuple[Block, dict[str, object]]] = {
    "a2a eager": (a2a_moe, {}),
    "ring (fp32 sums, default)": (ring_moe, {"routing": "expert"}),
    "ring (bf16 sums)": (ring_moe, {"routing": "expert", "fp32_accumulation": False}),
}


def layer_numerics(cfg: LayerConfig) -> NumericsResult:
    """Each leaf's error of the a2a layer and the ring on ``cfg``'s inputs (simulated EP), against fp32."""
    group = standin_group(cfg.ep)
    inp = make_inputs(cfg)
    inputs = BlockInputs(x_TH=inp.x_TH, topk_ids_TK=inp.topk_ids_TK, topk_scores_TK=inp.topk_scores_TK,
                         weights=inp.weights, grad_y_TH=inp.grad_y_TH)
    del inp
    blocks = {row: (block, {"group": group, **kw}) for row, (block, kw) in NUMERICS_ROWS.items()}
    errors = block_errors(blocks, inputs, a2a_moe, {"group": group})
    return NumericsResult(label=cfg.label(), truth="a2a_moe on the same inputs in fp32", errors=errors)

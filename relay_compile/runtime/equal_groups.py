"""equal_groups: a backward chunk's experts padded to equal rows, so its GEMMs run batched.

Why: at EP=64 a backward hop is one chunk of two experts, and its host time (the ring is host-bound there) has
four fp32 weight-gradient GEMMs in it, one per expert and weight (``addmm`` into the travelling sums, with the
views each needs). Where every expert of a chunk has the same rows, the grouped GEMMs run as ``torch.bmm`` and
each weight's gradients as one ``baddbmm`` (``grouped_gemm.uniform_rows``): half the dispatches, and on the
H200 less than half the host time at two experts, the same GPU time (``docs/bench/h200-uniform/``). Routed
experts seldom have equal rows, but a hop's experts are near-equal under a balanced router: padding each to
the most rows of its chunk costs a few percent of rows.

How: ``EqualGroups.plan`` picks the backward chunks of two or more experts whose padding is at most
``1 / MAX_PAD_DIVISOR`` of their rows and lays them out padded, expert by expert, in step-wide tables built on
the device once per step (``routing.padded_positions``): each padded row's token and score, the padding rows
on token 0 with score 0. Those add exact zeros to ``dx`` (their score-scaled output gradients are zero, so is
everything the backward derives from them) and to the weight gradients; their score gradients land in the
table's own ``ds_Q`` and only the real pairs' are copied into the step's (``scores_grad_into``, once per step).

Beside saved projections (``save_projections``) a padded chunk reads its rows' projections gathered into its
padded layout (``segment_compute._padded_projections``; a padding row takes a real pair's, times score 0).

On CUDA only (where ``uniform_rows`` batches): elsewhere the padding would be work for nothing.

Legend: P sorted pairs of a step, Q padded rows of a step, G experts of a chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from relay_compile.routing import Chunk, padded_positions

# A chunk is padded when that adds at most 1/MAX_PAD_DIVISOR of its rows (a balanced router's hop: ~1-2%).
MAX_PAD_DIVISOR = 16


def applies(device: torch.device) -> bool:
    """Whether a step on ``device`` pads its backward chunks (where the batched GEMMs run: CUDA)."""
    return device.type == "cuda"


@dataclass(frozen=True, kw_only=True)
class EqualChunk:
    """A chunk's place in the padded tables: ``groups`` experts of ``rows`` rows each from ``start``, and their
    grouped-GEMM offsets (``rows, 2 rows, ...``) on the device."""

    start: int
    groups: int
    rows: int
    offsets_G: Tensor

    @property
    def end(self) -> int:
        return self.start + self.groups * self.rows


class EqualGroups:
    """A step's padded backward chunks: ``tok_Q``/``score_Q`` (each padded row's token and score), ``pos_Q`` (its
    sorted pair, ``P`` for padding) and ``ds_Q`` (the score gradients the chunks write)."""

    def __init__(self, chunks: dict[int, EqualChunk], pos_Q: Tensor, tok_Q: Tensor, score_Q: Tensor) -> None:
        self._chunks, self.pos_Q, self.tok_Q, self.score_Q = chunks, pos_Q, tok_Q, score_Q
        self.ds_Q = torch.empty(pos_Q.shape, dtype=torch.float32, device=pos_Q.device)
        self.used = False  # a chunk ran padded (a backward without remat runs none: ``scores_grad_into``)

    def of(self, chunk: Chunk) -> EqualChunk | None:
        """``chunk``'s padded layout, if it has one (the caller then runs it padded)."""
        equal = self._chunks.get(id(chunk))
        self.used = self.used or equal is not None
        return equal

    @classmethod
    def plan(cls, hops: Sequence[Sequence[Chunk]], tokens_P: Tensor, scores_S: Tensor) -> EqualGroups | None:
        """The padded layout of every chunk worth padding (module docstring); None if there is none."""
        picked: list[tuple[Chunk, int]] = []  # (chunk, its experts' padded rows)
        first: list[int] = []  # per padded expert: its first sorted pair, real rows, padded rows
        real: list[int] = []
        padded: list[int] = []
        for hop in hops:
            for chunk in hop:
                rows, most, groups = chunk.end - chunk.start, max(chunk.rows, default=0), len(chunk.rows)
                if groups < 2 or (groups * most - rows) * MAX_PAD_DIVISOR > rows:
                    continue
                picked.append((chunk, most))
                pos = chunk.start
                for n in chunk.rows:
                    first.append(pos)
                    real.append(n)
                    padded.append(most)
                    pos += n
        if not picked:
            return None
        device = tokens_P.device
        pos_Q = padded_positions(first, real, padded, tokens_P.shape[0], device)
        offsets: list[int] = []
        offsets_at: list[int] = []
        for chunk, most in picked:  # each chunk's offsets 16-byte aligned, as routing.plan_chunks lays them out
            offsets_at.append(len(offsets))
            offsets += [most * (g + 1) for g in range(len(chunk.rows))]
            offsets += [0] * (-len(offsets) % 4)
        offsets_dev = torch.tensor(offsets, dtype=torch.int32, pin_memory=device.type == "cuda").to(
            device, non_blocking=True)
        chunks: dict[int, EqualChunk] = {}
        start = 0
        for (chunk, most), at in zip(picked, offsets_at, strict=True):
            groups = len(chunk.rows)
            chunks[id(chunk)] = EqualChunk(start=start, groups=groups, rows=most,
                                           offsets_G=offsets_dev[at : at + groups])
            start += groups * most
        tok_Q = torch.cat([tokens_P, tokens_P.new_zeros(1)])[pos_Q]
        score_Q = torch.cat([scores_S, scores_S.new_zeros(1)])[pos_Q]
        return cls(chunks, pos_Q, tok_Q, score_Q)

    def scores_grad_into(self, ds_S: Tensor) -> None:
        """Copy the real pairs' score gradients of the chunks that ran padded into the step's ``ds_S``
        ``(P + 1,)``: its last entry takes the padding rows' (one ``index_copy_``, no mask and no sync)."""
        if self.used:
            ds_S.index_copy_(0, self.pos_Q, self.ds_Q)

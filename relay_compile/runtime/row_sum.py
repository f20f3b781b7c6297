"""``RowSum``: a ring step's ``y`` or ``dx``, token rows summed across hops, finished in the tokens' dtype.

Expert routing sums every token's pairs over the N hops on its own rank, in fp32 where the tokens are bf16
(``RingStepConfig.sum_dtype``), and returns the sum in bf16 at ``finish``. Kept as one fp32 ``(T, H)`` tensor,
finishing allocates the bf16 result beside it: ``6 T H`` bytes at once, at the end of the backward where the
block's other buffers are smallest, which set the whole block's peak at EP=64 (docs/BENCHMARKS.md, "Bounded
hops by default"). So a widened sum is stored as two row blocks, rows ``[0, T1)`` and ``[T1, T)`` with
``T1 = ceil(T / 2)``, and ``finish`` narrows in place: the first block's ``4 T1 H`` bytes hold the whole bf16
result (``2 T H`` bytes), the second block is copied into their upper half and freed. The peak is the fp32
sum itself; the result owns exactly its storage.

Narrowing in place, front to back: bf16 row ``t`` is written at byte ``2 t H``, over fp32 row ``t / 2``, which
was read already. A copy of rows ``[a, b)`` reads bytes ``[4 a H, 4 b H)`` and writes ``[2 a H, 2 b H)``, so it
never overlaps itself when ``b <= 2 a``: after a first block narrowed through a small temporary, the blocks
double (about ``log2(T / NARROW_FIRST)`` copies).

Legend (docs/ARCHITECTURE.md): T tokens, H hidden, S rows of a chunk.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from relay_compile.kernels.scatter_add_rows import scatter_add_rows_

# Rows narrowed through a temporary before the in-place doubling blocks (its bf16 copy: 1024 x H x 2 bytes).
NARROW_FIRST = 1024


class RowSum:
    """``sum[tok[c]] += scale[c] * rows[c]`` over a step's hops; ``finish(dtype)`` gives the ``(T, H)`` result.

    ``RowSum(like_TH, dtype)``: zeros shaped like ``like_TH`` in ``dtype``, stored in two row blocks when
    ``dtype`` is twice as wide as ``like_TH``'s (the fp32 sum of bf16 or fp16 tokens, module docstring).
    ``RowSum.of(sum_TH)`` wraps an existing sum (token routing's first partials) as one block, ``RowSum.arriving``
    one that a transfer brings (token routing's travelling sums, added into on arrival).
    """

    # An arriving sum's tensor, waited for at its first add (``arriving``); None: the sum is here.
    _resolve: Callable[[], Tensor] | None = None

    def __init__(self, like_TH: Tensor, dtype: torch.dtype) -> None:
        rows = like_TH.shape[0]
        wide = torch.empty((), dtype=dtype).element_size() == 2 * like_TH.element_size()
        if wide and like_TH.dim() == 2 and rows >= 2:
            split = -(-rows // 2)
            self.head_TH = torch.zeros((split, like_TH.shape[1]), dtype=dtype, device=like_TH.device)
            self.tail_TH: Tensor | None = torch.zeros((rows - split, like_TH.shape[1]), dtype=dtype,
                                                      device=like_TH.device)
        else:
            self.head_TH, self.tail_TH = torch.zeros_like(like_TH, dtype=dtype), None

    @classmethod
    def of(cls, sum_TH: Tensor) -> RowSum:
        """An existing sum as one block (added into in place)."""
        self = cls.__new__(cls)
        self.head_TH, self.tail_TH = sum_TH, None
        return self

    @classmethod
    def arriving(cls, dtype: torch.dtype, resolve: Callable[[], Tensor]) -> RowSum:
        """A sum of ``dtype`` that arrives with a transfer (token routing's travelling ``y`` / ``dx``, a hop
        adding into them in place): ``resolve()`` waits for it and gives it, called at the first add only, so
        the hop computes before it waits."""
        self = cls.__new__(cls)
        self.head_TH, self.tail_TH, self._dtype, self._resolve = None, None, dtype, resolve  # type: ignore[assignment]
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype if self.head_TH is None else self.head_TH.dtype

    @property
    def here(self) -> bool:
        """Whether the sum is held here (not one that arrives with a transfer and is waited for at its first add)."""
        return self._resolve is None

    def blocks(self) -> tuple[Tensor, Tensor | None]:
        """The sum's row blocks ``(head, tail)`` to add into in place (``grouped_gemm.SumTarget``); an arriving sum
        is waited for here."""
        if self.head_TH is None:
            assert self._resolve is not None
            self.head_TH = self._resolve()
        return self.head_TH, self.tail_TH

    def add_(self, tok_S: Tensor, rows_SH: Tensor, scale_S1: Tensor | None = None) -> None:
        """``sum[tok[c]] += scale[c] * rows[c]`` (``kernels.scatter_add_rows``)."""
        head, tail = self.blocks()
        scatter_add_rows_(head, tok_S, rows_SH, scale_S1, tail_TH=tail)

    def finish(self, dtype: torch.dtype) -> Tensor:
        """The sum in ``dtype``; a two-block sum is narrowed in place and must not be added into afterwards."""
        if self.tail_TH is None:
            return self.head_TH.to(dtype)
        assert torch.empty((), dtype=dtype).element_size() * 2 == self.head_TH.element_size(), (
            f"RowSum: a sum stored in two blocks finishes in a dtype half as wide as {self.head_TH.dtype}, not {dtype}"
        )
        head, tail = self.head_TH, self.tail_TH
        self.tail_TH = None
        split, hidden = head.shape
        rows = split + tail.shape[0]
        out_TH = torch.empty(0, dtype=dtype, device=head.device).set_(
            head.untyped_storage(), 0, (rows, hidden), (hidden, 1))
        first = min(split, NARROW_FIRST)
        out_TH[:first] = head[:first].to(dtype)  # overlaps its own source: through a temporary
        a = first
        while a < split:
            b = min(2 * a, split)
            out_TH[a:b] = head[a:b]  # bytes [2aH, 2bH) written, [4aH, 4bH) read: disjoint as b <= 2a
            a = b
        out_TH[split:] = tail  # over head rows [split / 2, rows / 2): all read above
        self.head_TH = out_TH
        return out_TH

"""``RingOptions``: the options of one ring, validated once, with the one key every rank derives from them.

The functional API (``ring_moe``), the backend's options (``relay_compile.options``) and the rewrite pass all
build a ``RingOptions``; nothing else validates ``routing`` or ``max_hop_rows``. ``key()`` is part of the
ring's spec key (``runtime.specs``), a key of this process's registry. ``routing``, ``overlap``, ``remat`` and
``fp32_accumulation`` change what travels and when, so every rank must pass the same ones:
``runtime.agreement`` checks them at every call. ``max_hop_rows`` changes only how a rank cuts its own hops: it may differ across ranks and calls.

"No bound" on hop rows is ``None`` here; the process-wide config spells it ``0`` (config entries cannot be
None) and ``relay_compile.options`` converts it.
"""

from __future__ import annotations

from dataclasses import dataclass

from relay_compile.routing import ROUTINGS


class InvalidRingOption(ValueError):
    """An option value out of its domain; ``problem`` names the option and what is valid, ``argument`` the
    option (the name ``runtime.agreement`` reports to the other ranks)."""

    def __init__(self, problem: str, argument: str) -> None:
        super().__init__(problem)
        self.problem, self.argument = problem, argument


@dataclass(frozen=True, kw_only=True)
class RingOptions:
    """How a ring runs (all but ``max_hop_rows`` identical on every rank).

    - ``routing``: ``"expert"`` circulates weights, ``"token"`` circulates tokens, ``"auto"`` picks the one
      with less traffic per hop from the shapes of all ranks at the first call.
    - ``overlap``: post each hop's transfer before its compute (False: the sequential ring).
    - ``remat``: backward hops recompute and release their activations (False: replay the block first).
    - ``max_hop_rows``: rows of one expert call; hops with more pairs run in chunks (None: whole hops). A
      per-rank memory knob: nothing that travels depends on it.
    - ``fp32_accumulation``: what the ring sums across hops (weight gradients, and token routing's travelling
      outputs and input gradients) is summed and sent in fp32, as an fp32-accumulating GEMM of the
      all-to-all layer would sum it; False sums in the dtype of the summands (bf16: half the bytes of those
      transfers, one bf16 rounding per hop).
    """

    routing: str = "auto"
    overlap: bool = True
    remat: bool = True
    max_hop_rows: int | None = None
    fp32_accumulation: bool = True

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise InvalidRingOption(f"routing={self.routing!r} is not one of {ROUTINGS}", "routing")
        bound = self.max_hop_rows
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 1):
            raise InvalidRingOption(f"max_hop_rows must be a positive row count or None, got {bound!r}", "max_hop_rows")
        for name in ("overlap", "remat", "fp32_accumulation"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRingOption(f"{name} must be a bool, got {getattr(self, name)!r}", name)

    @classmethod
    def checked(
        cls, caller: str, *, routing: str = "auto", overlap: bool = True, remat: bool = True,
        max_hop_rows: int | None = None, fp32_accumulation: bool = True,
    ) -> RingOptions:
        """``RingOptions(...)``; a bad value raises ``InvalidRingOption("<caller>: <problem>")``."""
        try:
            return cls(routing=routing, overlap=overlap, remat=remat, max_hop_rows=max_hop_rows,
                       fp32_accumulation=fp32_accumulation)
        except InvalidRingOption as e:
            raise InvalidRingOption(f"{caller}: {e.problem}", e.argument) from None

    def key(self) -> str:
        """The options' part of a ring's spec key (stable across processes and ranks)."""
        return (
            f"routing={self.routing}|overlap={int(self.overlap)}|remat={int(self.remat)}"
            f"|max_hop_rows={self.max_hop_rows}|fp32_accumulation={int(self.fp32_accumulation)}"
        )

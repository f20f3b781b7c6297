"""``TokenSwitch``: one Dynamo graph compiled twice, its MoE regions kept or run as rings, chosen per call.

Where a region's token count T is dynamic, the backend compiles the graph once with those regions rewritten into
ring ops and once with them kept as traced (``passes.dynamic_keep``). Per call the switch:

1. reads this rank's T from the call's arguments (the plan knows which input holds each symbol of T);
2. agrees on every rank's T (``agreement.agree_tokens``: one exchange of the group's table; a rank whose
   graph differs raises with the others instead of waiting);
3. runs the kept variant where the cost model keeps every switched region at the largest T, else the ring
   variant. Every rank decides from the same table, so every rank runs the same variant.

The two variants are separate autograd functions, so a call's backward is the backward of the variant its
forward ran. The kept variant runs at the all-to-all's time and memory, as the static-T keep does. The ring
variant's ops still decide per call, with their own owners per hop, so near the threshold one may run the op's
own all-to-all path. ``calls`` counts each variant's calls (the graph's report shows it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from relay_compile.runtime.agreement import agree_tokens
from relay_compile.runtime.transport import RingGroup

log = logging.getLogger(__name__)


class SwitchRule(Protocol):
    """What the switch needs of its plan (``passes.dynamic_keep.SwitchPlan``)."""

    group_name: str
    device: torch.device

    def read_tokens(self, args: Sequence[Any]) -> int: ...

    def keeps(self, tokens: int) -> bool: ...


class TokenSwitch:
    """A compiled graph's callable: the kept or the ring variant per call (module docstring)."""

    def __init__(self, rule: SwitchRule, kept: Callable[..., Any], ring: Callable[..., Any], graph: str,
                 calls: dict[str, int]) -> None:
        self.rule, self.kept, self.ring, self.graph, self.calls = rule, kept, ring, graph, calls
        self._last: bool | None = None

    def __call__(self, *args: Any) -> Any:
        tokens = self.rule.read_tokens(args)
        tokens_N = agree_tokens(RingGroup.resolve(self.rule.group_name), self.rule.device, tokens)
        kept = self.rule.keeps(max(tokens_N))
        if kept != self._last:
            log.info("relaymoe %s: runs its %s variant from %d tokens per rank (the group's largest)", self.graph,
                     "kept" if kept else "ring", max(tokens_N))
            self._last = kept
        self.calls["kept" if kept else "ring"] += 1
        return (self.kept if kept else self.ring)(*args)

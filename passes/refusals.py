"""refusals: a token all-to-all the passes leave unchanged, and why.

Refusing is the answer to anything legal but not understood: the graph stays as it was, and the reason
(naming the node and what to do, where there is something to do) goes to the report and to the log.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx


@dataclass(frozen=True)
class RefusedRegion:
    """A token all-to-all left unchanged, and why."""

    node: fx.Node
    reason: str


class Refusal(Exception):
    """Raised inside the matcher where a region stops being understood; becomes a ``RefusedRegion``."""

    def __init__(self, node: fx.Node, reason: str) -> None:
        super().__init__(reason)
        self.node, self.reason = node, reason

    def record(self) -> RefusedRegion:
        return RefusedRegion(self.node, self.reason)

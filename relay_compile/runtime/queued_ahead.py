"""``QueuedAhead``: what one ring op call computes from its arguments alone, queued on the compute stream before
the host waits for the call's agreement.

The host reads the agreement's table once per call (the counts size every hop), then checks it, decides, builds
the program and plans the chunks before it queues the first hop. Whatever the device had queued before the read
was done by then, so the device idled through that host work: ~0.3 ms after the forward's read and ~0.2 ms
after the backward's at EP=8, 65536 tokens on an H100 (docs/BENCHMARKS.md, "Where the GPU waits on the host").
The pairs' sort by expert, their scores in that order and the zeroed sum of ``y`` or ``dx`` need no count. The
agreement gathers beside the compute stream and reads the table as soon as its exchange is done
(``agreement._read``); this work is queued between the exchange and that read (``agree(before_read=...)``), so
the device sorts and fills while the host waits and plans.

What is queued follows the execution the call's spec ran last (``SpecState.resolved``): the sort for an expert
ring or the all-to-all path, and the sum only for an expert ring (the all-to-all path allocates its sum after
its combine, where it sets no peak; token routing sorts each visiting partition, not its own). ``take`` hands the
queued work to a call that runs what was predicted and drops it otherwise: a call whose execution changed (a
token count crossing the cost model's threshold) zero-filled a sum for nothing, at the point where it would have
allocated it anyway. Legend (docs/ARCHITECTURE.md): T tokens, H hidden, K top-k, P = T*K pairs.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from relay_compile.routing import PairOrder
from relay_compile.runtime.cost_model import Execution
from relay_compile.runtime.row_sum import RowSum
from relay_compile.runtime.segment_compute import RingStepConfig

log = logging.getLogger(__name__)


class QueuedAhead:
    """The count-free work of one call (module docstring): ``queue`` it as the agreement's ``before_read``,
    then ``take`` it for the execution agreed."""

    def __init__(self, predicted: Execution | None, cfg: RingStepConfig, x_TH: Tensor, topk_ids_TK: Tensor,
                 topk_scores_TK: Tensor) -> None:
        self.predicted, self.cfg = predicted, cfg
        self.x_TH, self.topk_ids_TK, self.topk_scores_TK = x_TH, topk_ids_TK, topk_scores_TK
        self.order: PairOrder | None = None
        self.sum_TH: RowSum | None = None

    def queue(self) -> None:
        if self.predicted not in ("expert", "all_to_all"):
            return
        # Out of memory here is left to the step, which plans what is missing where a failure drains
        # (ring_step.guarded_setup): raising between the exchange and its read would leave the peers waiting for this
        # rank's transfers.
        try:
            self.order = PairOrder.of(self.topk_ids_TK, self.topk_scores_TK)
            if self.predicted == "expert":
                self.sum_TH = RowSum(self.x_TH, self.cfg.sum_dtype(self.x_TH))
        except torch.OutOfMemoryError:
            log.debug("ring_moe: count-free work not queued ahead", exc_info=True)
            self.sum_TH = None

    def take(self, execution: Execution) -> tuple[PairOrder | None, RowSum | None]:
        """The sort (expert ring, all-to-all path) and the sum (expert ring) where they were queued for this
        execution; released here either way, so a call that runs otherwise holds none of it."""
        order, sum_TH = self.order, self.sum_TH
        self.order = self.sum_TH = None
        return (order if execution in ("expert", "all_to_all") else None,
                sum_TH if execution == "expert" else None)

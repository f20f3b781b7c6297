"""``runtime.queued_ahead``: a ring op call queues its count-free work (the pairs' sort, the sum) between its
agreement's exchange and the table's read, hands it to the step that runs what was predicted, and drops it
otherwise; results are those of the step planning it itself. Stand-in group of 4 (one process, CPU)."""

from __future__ import annotations

import unittest
import unittest.mock

import torch
from torch import Tensor

from relay_compile import ring_moe
from relay_compile.bench import standin_group
from relay_compile.reference import moe_weights
from relay_compile.runtime import agreement, queued_ahead
from relay_compile.runtime.all_to_all import AllToAllStep
from relay_compile.runtime.hop_compute import ExpertRoutingStep, TokenRoutingStep
from tests.bench.standin_case import StandinTestCase

T, H, F, K, WORLD, E_L = 24, 8, 6, 2, 4, 2


def _call(**options) -> list[Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen, requires_grad=True)
    ids = torch.randint(0, WORLD * E_L, (T, K), generator=gen)
    scores = torch.rand(T, K, generator=gen, requires_grad=True)
    w = moe_weights(0, H, F, E_L)
    weights = [w[k].requires_grad_() for k in ("w1", "w2", "w3")]
    y = ring_moe(x, ids, scores, *weights, group=standin_group(WORLD), **options)
    return [y.detach(), *torch.autograd.grad(y, [x, scores, *weights], torch.ones_like(y))]


def _spied(cls: type) -> tuple[list[dict], object]:
    """``cls.__init__`` recording each call's keyword arguments."""
    seen: list[dict] = []
    init = cls.__init__

    def spy(self, *args, **kwargs):
        seen.append(kwargs)
        init(self, *args, **kwargs)

    return seen, unittest.mock.patch.object(cls, "__init__", spy)


class QueuedAheadOfTheRead(StandinTestCase):
    def test_an_expert_ring_call_plans_on_the_work_queued_for_it(self) -> None:
        first = _call(routing="expert", ring="always")  # its spec ran nothing yet: nothing queued
        seen, spy = _spied(ExpertRoutingStep)
        with spy:
            again = _call(routing="expert", ring="always")
        self.assertEqual(len(seen), 2)  # forward and backward
        for kwargs in seen:
            self.assertIsNotNone(kwargs["order"])
            self.assertIsNotNone(kwargs["sum_TH"])
        for a, b in zip(first, again, strict=True):
            self.assertTrue(torch.equal(a, b))

    def test_the_all_to_all_path_takes_the_sort_only_and_token_routing_takes_none(self) -> None:
        _call(routing="expert", ring="never")
        seen, spy = _spied(AllToAllStep)
        with spy:
            _call(routing="expert", ring="never")
        self.assertEqual([k["order"] is not None for k in seen], [True, True])
        _call(routing="token", ring="always")
        seen, spy = _spied(TokenRoutingStep)
        with spy:
            _call(routing="token", ring="always")
        self.assertEqual(len(seen), 2)
        self.assertTrue(all("order" not in k and "sum_TH" not in k for k in seen))

    def test_the_work_is_queued_after_the_exchange_is_posted_and_before_the_table_is_read(self) -> None:
        events: list[str] = []
        gather, real_queue = agreement.all_gather_rows, queued_ahead.QueuedAhead.queue

        class ReadLogged(Tensor):
            def tolist(self):
                events.append("read")
                return super().tolist()

        def logged_gather(ring, row):
            events.append("exchange")
            return gather(ring, row).as_subclass(ReadLogged)

        def logged_queue(self):
            events.append("queue")
            real_queue(self)

        _call(routing="expert", ring="always")
        with unittest.mock.patch.object(agreement, "all_gather_rows", logged_gather), \
                unittest.mock.patch.object(queued_ahead.QueuedAhead, "queue", logged_queue):
            _call(routing="expert", ring="always")
        self.assertEqual(events, ["exchange", "queue", "read"] * 2)  # forward, backward

    def test_a_failure_while_queueing_leaves_the_work_to_the_step(self) -> None:
        # Out of memory, say, before the table is read: the peers read it and start the ring, so this rank must
        # not raise there; its step plans the sum itself, where a failure drains (ring_step.guarded_setup).
        want = _call(routing="expert", ring="always")

        def out_of_memory(*args, **kwargs):
            raise torch.OutOfMemoryError("no room for the sum")

        seen, spy = _spied(ExpertRoutingStep)
        with unittest.mock.patch.object(queued_ahead, "RowSum", out_of_memory), spy:
            got = _call(routing="expert", ring="always")
        self.assertEqual([(k["order"] is not None, k["sum_TH"]) for k in seen], [(True, None)] * 2)  # the sort kept
        for a, b in zip(want, got, strict=True):
            self.assertTrue(torch.equal(a, b))


if __name__ == "__main__":
    unittest.main()

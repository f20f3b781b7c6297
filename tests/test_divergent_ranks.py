"""Ranks that compile different graphs of one MoE block never hang: either every rank rewrites it or every rank
raises, at the block's first collective.

A graph break on rank 0 only (``variants.a2a_moe_breaks_on_rank_0``: a debugging hook on one rank) splits rank
0's block into two refused halves while rank 1 rewrites it: rank 0's refused all-to-alls run behind
``relaymoe::kept_all_to_all`` (``rewrite.guard_refused``), whose exchange meets rank 1's ring op's, and both
raise ``RingInputError`` naming the disagreement, well inside the process group's timeout. A warning and a
print on rank 0 only (``variants.a2a_moe_warns_on_rank_0``) break no graph under the backend's settings
(``dynamo_settings.LOGGING_FUNCTIONS``): both ranks rewrite the block and train like eager.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.testing._internal.common_utils import run_tests

from relay_compile.backend import compiled_reports
from relay_compile.reference import moe_weights
from relay_compile.runtime.agreement import RingInputError
from tests.distributed import DistributedTestCase
from tests.models import variants

H, F, E, K, T = 16, 8, 4, 2, 12


class DivergentRanks(DistributedTestCase):
    def inputs(self) -> tuple[torch.Tensor, ...]:
        e_l = E // self.world_size
        w = moe_weights(0, H, F, E, experts=range(self.rank * e_l, (self.rank + 1) * e_l))
        gen = torch.Generator().manual_seed(self.rank)
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
        return torch.randn(T, H, generator=gen), ids, torch.rand(T, K, generator=gen), w["w1"], w["w2"], w["w3"]

    def test_a_break_on_one_rank_raises_on_every_rank_and_a_warning_on_one_rank_still_rewrites(self) -> None:
        group = self.init_pg()
        x, ids, scores, w1, w2, w3 = self.inputs()

        def run(variant):
            def fn(x, scores):
                return variant(x, ids, scores, w1, w2, w3, group=group)

            torch._dynamo.reset()
            seen = len(compiled_reports())
            compiled = torch.compile(fn, backend="relaymoe", options={"inner_compiler": "aot_eager"})
            return fn, compiled, seen

        # A break on rank 0 only: every rank raises, none waits for the others.
        _, compiled, seen = run(variants.a2a_moe_breaks_on_rank_0)
        start = time.monotonic()
        with self.assertRaisesRegex(RingInputError, "compiled different graphs of this MoE block"):
            compiled(x, scores)
        self.assertLess(time.monotonic() - start, 60, "the ranks waited on each other")
        statuses = sorted(r.status for report in compiled_reports()[seen:] for r in report.regions)
        # Rank 0 compiled the dispatch half only: the error stopped it before the combine half.
        self.assertEqual(statuses, ["refused"] if self.rank == 0 else ["rewritten"], statuses)
        dist.barrier()

        # A warning and a print on rank 0 only: one graph on every rank, rewritten, equal to eager.
        fn, compiled, seen = run(variants.a2a_moe_warns_on_rank_0)
        for f in (fn, compiled):
            leaves = [x.clone().requires_grad_(), scores.clone().requires_grad_()]
            y = f(*leaves)
            y.pow(2).sum().backward()
            if f is fn:
                want = [y.detach(), *(t.grad for t in leaves)]
        for g, w in zip([y.detach(), *(t.grad for t in leaves)], want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        statuses = [r.status for report in compiled_reports()[seen:] for r in report.regions]
        self.assertEqual(statuses, ["rewritten"], statuses)


if __name__ == "__main__":
    run_tests()

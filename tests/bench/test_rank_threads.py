"""Ranks as threads of one process (``bench.rank_threads``): the group's semantics, and MoE blocks on it.

On CPU, in the test process: point-to-point order and tags, all-to-all splits, the collectives, failures and
timeouts (fail fast, naming ranks), per-rank peaks (the counting allocator's thread tags), and ``a2a_moe``,
``ring_moe`` (both routings) and the backend on every-rank-real groups, against an fp32 truth computed from every
rank's inputs on one thread (the stand-in cannot check token routing: ``bench.standin_group``).
"""

from __future__ import annotations

import time
import unittest

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from relay_compile import ring_moe
from relay_compile.backend import compiled_reports
from relay_compile.bench.rank_peak import _stream_peak
from relay_compile.bench.rank_threads import RankPeak, RankThreadsError, run_rank_threads
from relay_compile.bench.routers import Skew
from relay_compile.reference import AllToAllMoE, a2a_moe, dense_moe, moe_weights
from tests.test_memory import needs_build
from tests.test_ring_moe import F, H, ROUTER_CASES, assert_close_rel, local_weights, routed_inputs


class GroupSemantics(unittest.TestCase):
    def test_sends_match_receives_by_source_tag_and_posting_order(self) -> None:
        def step(rank: int, group: dist.ProcessGroup) -> list[list[float]]:
            n = group.size()
            if rank == 0:  # receives posted before the sends, tags out of order
                outs = [torch.empty(2) for _ in range(4)]
                works = [dist.irecv(outs[0], 1, tag=7), dist.irecv(outs[1], 1, tag=3),
                         dist.irecv(outs[2], 1, tag=3), dist.irecv(outs[3], n - 1, tag=0)]
                for w in works:
                    w.wait()
            if rank == 1:
                works = [dist.isend(torch.tensor([30.0, 1]), 0, tag=3), dist.isend(torch.tensor([31.0, 1]), 0, tag=3),
                         dist.isend(torch.tensor([7.0, 1]), 0, tag=7)]
                for w in works:
                    w.wait()
            if rank == n - 1:
                dist.send(torch.tensor([float(rank), 0]), 0)
            # A ring shift, as the ring posts it.
            out = torch.empty(1)
            ops = [dist.P2POp(dist.isend, torch.tensor([float(rank)]), (rank + 1) % n),
                   dist.P2POp(dist.irecv, out, (rank - 1) % n)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            return [o.tolist() for o in outs] + [out.tolist()] if rank == 0 else [out.tolist()]

        got = run_rank_threads(3, step, timeout=10)
        self.assertEqual(got[0], [[7.0, 1], [30.0, 1], [31.0, 1], [2.0, 0], [2.0]])
        self.assertEqual([g[-1] for g in got[1:]], [[0.0], [1.0]])

    def test_all_to_all_moves_uneven_splits_and_refuses_splits_that_disagree(self) -> None:
        def step(rank: int, group: dist.ProcessGroup) -> list[float]:
            n = group.size()
            send_splits = [(rank + d) % 3 for d in range(n)]  # rank r sends (r + d) % 3 rows to d
            recv_splits = [(s + rank) % 3 for s in range(n)]
            rows = torch.cat([torch.full((k,), 10.0 * rank + d) for d, k in enumerate(send_splits)])
            out = funcol.wait_tensor(funcol.all_to_all_single(rows, recv_splits, send_splits, group))
            return out.tolist()

        got = run_rank_threads(3, step, timeout=10)
        for rank, rows in enumerate(got):
            want = [10.0 * s + rank for s in range(3) for _ in range((s + rank) % 3)]
            self.assertEqual(rows, want)

        def bad(rank: int, group: dist.ProcessGroup) -> None:
            out = torch.empty(2 if rank == 0 else 1)
            dist.all_to_all_single(out, torch.zeros(2), [1, 1] if rank == 0 else [0, 1], [1, 1])

        with self.assertRaisesRegex(RankThreadsError, r"rank 1 expects \(0,\) from rank 0, which sends \(1,\)"):
            run_rank_threads(2, bad, timeout=10)

    def test_collectives_reduce_gather_scatter_and_broadcast_across_ranks(self) -> None:
        def step(rank: int, group: dist.ProcessGroup) -> dict[str, list[float]]:
            n = group.size()
            v = torch.tensor([rank + 1.0, -rank])
            out = {}
            for name, op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX), ("avg", dist.ReduceOp.AVG)):
                t = v.clone()
                dist.all_reduce(t, op=op)
                out[name] = t.tolist()
            gathered = torch.empty(2 * n)
            dist.all_gather_into_tensor(gathered, v)
            out["gather"] = gathered.tolist()
            scattered = torch.empty(1)
            dist.reduce_scatter_tensor(scattered, torch.arange(n, dtype=torch.float32) * (rank + 1))
            out["reduce_scatter"] = scattered.tolist()
            b = v.clone()
            dist.broadcast(b, src=n - 1)
            out["broadcast"] = b.tolist()
            dist.barrier()
            sub = dist.new_group([0, 2])  # every rank creates it, as with processes
            if rank in (0, 2):
                s = torch.tensor([float(rank)])
                dist.all_reduce(s, group=sub)
                out["subgroup"] = s.tolist()
            return out

        got = run_rank_threads(3, step, timeout=10)
        for rank, out in enumerate(got):
            self.assertEqual(out["sum"], [6.0, -3.0])
            self.assertEqual(out["max"], [3.0, 0.0])
            self.assertEqual(out["avg"], [2.0, -1.0])
            self.assertEqual(out["gather"], [1.0, 0.0, 2.0, -1.0, 3.0, -2.0])
            self.assertEqual(out["reduce_scatter"], [rank * 6.0])
            self.assertEqual(out["broadcast"], [3.0, -2.0])
            self.assertEqual(out.get("subgroup"), [2.0] if rank in (0, 2) else None)

    def test_a_failing_rank_fails_the_others_at_once_and_a_lost_receive_times_out(self) -> None:
        def step(rank: int, group: dist.ProcessGroup) -> None:
            if rank == 1:
                raise ValueError("rank 1 broke")
            dist.all_reduce(torch.ones(1))

        start = time.monotonic()
        with self.assertRaisesRegex(ValueError, "rank 1 broke") as caught:
            run_rank_threads(3, step, timeout=30)
        self.assertLess(time.monotonic() - start, 10, "the waiting ranks did not notice the failure")
        self.assertIn("rank 0: RankThreadsError", "\n".join(caught.exception.__notes__))

        def lost(rank: int, group: dist.ProcessGroup) -> None:
            if rank == 0:
                dist.recv(torch.empty(1), 1, tag=5)  # rank 1 never sends

        with self.assertRaisesRegex(RankThreadsError, r"rank 0: receive from rank 1 \(tag 5\) waited more than 1 s"):
            run_rank_threads(2, lost, timeout=1)

        def out_of_order(rank: int, group: dist.ProcessGroup) -> None:
            (dist.barrier if rank == 0 else lambda: dist.all_reduce(torch.ones(1)))()

        with self.assertRaisesRegex(RankThreadsError, "every rank must call the same collectives"):
            run_rank_threads(2, out_of_order, timeout=10)

    @needs_build
    def test_each_rank_measures_its_own_peak(self) -> None:
        def step(rank: int, group: dist.ProcessGroup) -> int:
            dist.barrier()
            with RankPeak("cpu") as peak:
                big = torch.ones((rank + 1) * (1 << 20), dtype=torch.uint8)  # (rank + 1) MiB, while others do too
                dist.barrier()
                del big
                small = torch.ones(1 << 10, dtype=torch.uint8)
                dist.barrier()
            del small
            return peak.peak_bytes

        peaks = run_rank_threads(3, step, timeout=10)
        for rank, peak in enumerate(peaks):
            self.assertGreaterEqual(peak, (rank + 1) << 20)
            self.assertLess(peak, ((rank + 1) << 20) + (1 << 16), f"rank {rank} counted another rank's bytes")

    def test_a_cuda_ranks_peak_is_read_from_its_streams_events_between_its_markers(self) -> None:
        """``RankPeak`` on CUDA reads the memory history (its logic here, on a written trace): another stream's
        events, events outside the markers and the markers' own blocks do not count."""
        def ev(action: str, size: int, addr: int, stream: int = 1) -> dict[str, int | str]:
            return {"action": action, "size": size, "addr": addr, "stream": stream}

        trace = [ev("alloc", 512, 1), ev("alloc", 1024, 2),  # an older measurement's markers
                 ev("alloc", 4096, 3), ev("alloc", 512, 4), ev("alloc", 1024, 5),  # this one opens
                 ev("free_completed", 512, 4), ev("free_completed", 1024, 5),
                 ev("alloc", 100, 6), ev("alloc", 10**6, 7, stream=2), ev("free_completed", 4096, 3),
                 ev("alloc", 300, 8), ev("alloc", 200, 9), ev("free_completed", 300, 8),
                 ev("alloc", 1536, 10), ev("alloc", 2048, 11), ev("alloc", 10**5, 12)]  # closes; after it
        self.assertEqual(_stream_peak(trace, 1, (512, 1024, 1536, 2048)), 100)  # before the older block is freed
        # A deferred free the allocator completes inside the second marker's allocation: the markers still
        # open, and the freed older block counts (the peak is above the level at entry).
        deferred = [*trace[:4], ev("free_completed", 64, 13), *trace[4:]]
        self.assertEqual(_stream_peak(deferred, 1, (512, 1024, 1536, 2048)), 36)
        with self.assertRaisesRegex(RankThreadsError, "lost this measurement's markers"):
            _stream_peak(trace, 2, (512, 1024, 1536, 2048))


def truth(inputs: list[tuple[Tensor, Tensor, Tensor]], grads: list[Tensor], num_experts: int) -> list[list[Tensor]]:
    """Every rank's ``y`` and gradients from ``dense_moe`` over all experts, in fp64 on one thread; a rank's
    weight gradients are its experts' rows of the gradients summed over all ranks' tokens."""
    full = moe_weights(0, H, F, num_experts, dtype=torch.float64)
    weights = [full[n].requires_grad_() for n in ("w1", "w2", "w3")]
    out = []
    for (x, ids, scores), g in zip(inputs, grads, strict=True):
        x64, s64 = x.double().requires_grad_(), scores.double().requires_grad_()
        y = dense_moe(x64, ids, s64, *weights)
        dx, ds = torch.autograd.grad(y, [x64, s64], g.double(), retain_graph=True)
        y.backward(g.double())
        out.append([y.detach(), dx, ds])
    e_l = num_experts // len(inputs)
    for rank, rank_out in enumerate(out):
        rank_out += [w.grad[rank * e_l:(rank + 1) * e_l] for w in weights]
    return out


class MoEOnRankThreads(unittest.TestCase):
    e_l = 2

    def check_blocks(self, world: int, case: str) -> None:
        e = self.e_l * world
        inputs = [routed_inputs(case, r, world, e, seed=3) for r in range(world)]
        grads = [torch.randn(x.shape, generator=torch.Generator().manual_seed(r)) for r, (x, _, _) in enumerate(inputs)]
        want = truth(inputs, grads, e)

        def step(rank: int, group: dist.ProcessGroup) -> dict[str, list[Tensor]]:
            x, ids, scores = inputs[rank]
            out = {}
            for name, fn, kw in (("a2a", a2a_moe, {}), ("expert", ring_moe, {"routing": "expert"}),
                                 ("token", ring_moe, {"routing": "token"})):
                leaves = [t.clone().requires_grad_() for t in (x, scores, *local_weights(rank, self.e_l, world))]
                y = fn(leaves[0], ids, leaves[1], *leaves[2:], group=group, **kw)
                out[name] = [y.detach(), *torch.autograd.grad(y, leaves, grads[rank])]
            return out

        got = run_rank_threads(world, step, timeout=20)
        for rank in range(world):
            for name, values in got[rank].items():
                for leaf, g, w in zip(("y", "dx", "d_scores", "dw1", "dw2", "dw3"), values, want[rank], strict=True):
                    assert_close_rel(g, w.float(), 1e-5, f"EP={world} {case} rank {rank} {name} {leaf}")

    def test_a2a_and_both_routings_equal_the_truth_on_every_rank(self) -> None:
        for case in ROUTER_CASES:
            self.check_blocks(2, case)
        for case in ("random", "one_expert", "uneven"):
            self.check_blocks(4, case)

    def test_token_routing_differs_from_the_truth_when_a_rank_computes_the_wrong_experts(self) -> None:
        """The comparison above can fail: rank 1 holding rank 0's experts changes its results."""
        inputs = [routed_inputs("random", r, 2, 4, seed=3) for r in range(2)]

        def step(rank: int, group: dist.ProcessGroup) -> Tensor:
            x, ids, scores = inputs[rank]
            return ring_moe(x, ids, scores, *local_weights(0, self.e_l, 2), group=group, routing="token")

        want = truth(inputs, [torch.zeros_like(x) for x, _, _ in inputs], 4)
        got = run_rank_threads(2, step, timeout=20)
        self.assertFalse(torch.allclose(got[0], want[0][0].float(), rtol=1e-3, atol=1e-3))

    @needs_build
    def test_a_hot_expert_raises_its_ranks_all_to_all_peak_and_not_the_rings(self) -> None:
        world, e_l, tokens = 4, 2, 512
        e = world * e_l

        def step(rank: int, group: dist.ProcessGroup) -> dict[str, int]:
            gen = torch.Generator().manual_seed(rank)
            x = torch.randn(tokens, 64, generator=gen)
            ids = torch.stack([torch.randperm(e, generator=gen)[:2] for _ in range(tokens)])
            ids[:, 0] = e - 1  # every token's first choice: the last expert, on the last rank
            scores = torch.rand(tokens, 2, generator=gen)
            w = moe_weights(0, 64, 32, e, experts=range(rank * e_l, (rank + 1) * e_l))
            peaks = {}
            for name, fn, kw in (("a2a", a2a_moe, {}), ("ring", ring_moe, {"routing": "expert"})):
                leaves = [t.clone().requires_grad_() for t in (x, scores, w["w1"], w["w2"], w["w3"])]
                dist.barrier()
                with RankPeak("cpu") as peak:
                    fn(leaves[0], ids, leaves[1], *leaves[2:], group=group, **kw).sum().backward()
                peaks[name] = peak.peak_bytes
            return peaks

        peaks = run_rank_threads(world, step, timeout=30)
        a2a, ring = [p["a2a"] for p in peaks], [p["ring"] for p in peaks]
        self.assertGreater(a2a[-1], 1.5 * max(a2a[:-1]), f"a2a peaks per rank {a2a}")
        self.assertLess(max(ring), 1.25 * min(ring), f"ring peaks per rank {ring}")
        self.assertLess(max(ring), a2a[-1] / 2, f"ring {ring} against a2a {a2a}")


class NumericsSection(unittest.TestCase):
    """The bench's ``numerics`` preset, every rank real: each row's leaf errors against fp32 from all ranks."""

    def test_fp32_rings_match_the_truth_and_bf16_errors_are_bf16_sized(self) -> None:
        from relay_compile.bench.configs import LayerConfig
        from relay_compile.bench.numerics import LEAVES
        from relay_compile.bench.real_ranks import real_rank_numerics

        cfg = LayerConfig(name="tiny", hidden=64, ffn=32, experts=8, top_k=4, tokens=96, ep=2, device="cpu",
                          dtype="fp32")
        exact = real_rank_numerics(cfg, "zipf:1.2:uneven", timeout=20)
        self.assertIn("every rank real, router zipf:1.2:uneven", exact.label)
        self.assertEqual(set(exact.errors), {"a2a eager", "ring expert", "ring token"})
        for row, errors in exact.errors.items():
            self.assertEqual(tuple(errors), (*LEAVES, *(f"{leaf} rms" for leaf in LEAVES)))
            self.assertLess(max(errors.values()), 1e-5, f"fp32 {row}: {errors}")

    def test_the_numerics_preset_adds_a_section_per_router_with_bf16_sized_errors(self) -> None:
        from relay_compile.bench.__main__ import _numerics
        import io

        from relay_compile.bench.configs import BenchOptions, LayerConfig
        from relay_compile.bench.progress import Progress
        from relay_compile.bench.real_ranks import NUMERICS_ROUTERS
        from relay_compile.bench.results import Report

        cfg = LayerConfig(name="tiny", hidden=64, ffn=32, experts=8, top_k=4, tokens=96, ep=2, device="cpu")
        report = Report(options=BenchOptions())
        _numerics([], [cfg]).run(report, Progress(io.StringIO()), None)
        self.assertEqual([n.label.rsplit(" ", 1)[-1] for n in report.numerics], list(NUMERICS_ROUTERS))
        for n in report.numerics:  # bf16 rounds: errors above fp32's, far below a wrong result's
            for row, errors in n.errors.items():
                self.assertTrue(all(1e-4 < e < 5e-2 for e in errors.values()), f"{n.label} {row}: {errors}")
        self.assertIn("every rank real, router hot_expert:inf", report.markdown())


class SkewSearch(unittest.TestCase):
    @needs_build
    def test_the_search_finds_the_all_to_alls_largest_hot_rank_share_within_a_budget_and_the_ring_takes_all(
        self,
    ) -> None:
        from relay_compile.bench.configs import LayerConfig
        from relay_compile.bench.real_ranks import largest_skew, row_run

        cfg = LayerConfig(name="tiny", hidden=64, ffn=32, experts=8, top_k=2, tokens=512, ep=4, device="cpu",
                          dtype="fp32")
        peak = lambda row, share: max(r["peak"] for r in row_run(cfg, Skew("hot_rank", share), row))  # noqa: E731
        budget = (peak("a2a eager", 0.25) + peak("a2a eager", 1.0)) // 2
        a2a = largest_skew(cfg, "hot_rank", "a2a eager", budget, 0.25, 1.0, probes=4)
        self.assertTrue(0.25 <= a2a["share"] < 1.0, a2a)
        self.assertLessEqual(a2a["peak"], budget)
        above = [p for s, p in a2a["probes"] if s > a2a["share"]]
        self.assertTrue(above and min(above) > budget, a2a)  # every larger share tried ran over
        ring = largest_skew(cfg, "hot_rank", "ring expert", budget, 0.25, 1.0, probes=4)
        self.assertEqual((ring["share"], len(ring["probes"])), (1.0, 1), ring)  # every pair on one rank fits
        self.assertGreater(ring["rank_share"], 0.99)
        none = largest_skew(cfg, "hot_rank", "a2a eager", 1, 0.25, 1.0)
        self.assertIsNone(none["share"])


class CapacityRow(unittest.TestCase):
    def test_capacity_keeps_first_choices_first_then_token_order_and_drops_the_rest(self) -> None:
        from relay_compile.bench.real_ranks import capacity_kept

        ids = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 3], [0, 1], [2, 3]])  # T=6, K=2, E=4: 12 pairs, cap 3
        kept = capacity_kept(ids, 4, 1.0)
        want = torch.tensor([[1, 1], [1, 1], [1, 0], [1, 1], [0, 1], [1, 1]], dtype=torch.bool)
        self.assertTrue(torch.equal(kept, want), kept)  # expert 0: first choices of tokens 0, 1, 3; rest dropped
        self.assertTrue(capacity_kept(ids, 4, 10.0).all())


class BackendOnRankThreads(unittest.TestCase):
    def test_the_backend_rewrites_every_ranks_block_and_equals_eager(self) -> None:
        torch._dynamo.reset()
        seen = len(compiled_reports())

        def step(rank: int, group: dist.ProcessGroup) -> list[Tensor]:
            moe = AllToAllMoE(H, F, 4, 2, group=group, seed=0, use_grouped_mm=False)
            compiled = torch.compile(moe, backend="relaymoe", options={"inner_compiler": "aot_eager"})
            out = []
            for i in range(2):
                x = torch.randn(2, 6 + rank, H, generator=torch.Generator().manual_seed(10 * i + rank))
                for fn in (moe, compiled):
                    moe.zero_grad(set_to_none=True)
                    leaf = x.clone().requires_grad_()
                    y = fn(leaf)
                    y.pow(2).sum().backward()
                    out.append([y.detach(), leaf.grad, *(p.grad for p in moe.parameters())])
            return out

        got = run_rank_threads(2, step, timeout=60)
        for rank, steps in enumerate(got):
            for i in range(0, len(steps), 2):
                for g, w in zip(steps[i + 1], steps[i], strict=True):
                    torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"rank {rank} step {i // 2}")
        statuses = [r.status for report in compiled_reports()[seen:] for r in report.regions]
        self.assertTrue(statuses and all(s == "rewritten" for s in statuses), statuses)


if __name__ == "__main__":
    unittest.main()

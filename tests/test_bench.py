"""The single-device benchmark harness: the stand-in EP group's model, MoE numerics under it, the tiny preset.

Everything runs in this process, as rank 0 of stand-in groups (``relay_compile.bench.standin_group``); the
stand-in world is torn down after each class, so other tests never see torch.distributed initialized.
"""

from __future__ import annotations

import json
import tempfile
import unittest
import unittest.mock
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from relay_compile import ring_moe
from relay_compile.bench import StandinError, StandinGroup, destroy_standin_groups, single_layer, standin_group
from relay_compile.bench.single_layer import (
    A2A_EAGER,
    BenchOptions,
    LayerConfig,
    RowSpec,
    _a2a_eager,
    capacity_search,
    link_model,
    measure_layer,
)
from relay_compile.reference import a2a_moe, dense_moe, moe_weights

try:
    import matplotlib  # noqa: F401

    HAVE_MATPLOTLIB = True
except ImportError:
    HAVE_MATPLOTLIB = False


def setUpModule() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


class StandinTestCase(unittest.TestCase):
    @classmethod
    def tearDownClass(cls) -> None:
        destroy_standin_groups()
        super().tearDownClass()


class StandinGroupCollectivesFollowTheCopiesModel(StandinTestCase):
    def test_a_ring_shift_receives_the_tensor_just_sent(self) -> None:
        group = standin_group(4)
        sent, got = torch.arange(6.0), torch.zeros(6)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, sent, 1, group, 7),
            dist.P2POp(dist.irecv, got, 3, group, 7),
        ])
        for w in works:
            w.wait()
        self.assertTrue(torch.equal(got, sent))

    def test_a_receive_from_src_mirrors_the_send_to_minus_src_and_matches_tags(self) -> None:
        group = standin_group(4)
        to_2, to_1 = torch.full((3,), 2.0), torch.full((3,), 1.0)
        got_from_2, got_from_3 = torch.zeros(3), torch.zeros(3)
        w_recv = dist.irecv(got_from_2, 2, group, tag=5)  # posted before its send: completes when it arrives
        self.assertFalse(w_recv.is_completed())
        dist.isend(to_1, 1, group, tag=5)
        dist.isend(to_2, 2, group, tag=5)
        self.assertTrue(w_recv.is_completed())
        dist.irecv(got_from_3, 3, group, tag=5).wait()  # mirrors the send to (0 - 3) mod 4 = 1
        self.assertTrue(torch.equal(got_from_2, to_2))
        self.assertTrue(torch.equal(got_from_3, to_1))

    def test_waiting_on_a_receive_that_no_send_mirrors_fails_loudly(self) -> None:
        group = standin_group(4)
        work = dist.irecv(torch.zeros(2), 1, group, tag=99)
        with self.assertRaisesRegex(StandinError, "before this rank posted the send it mirrors"):
            work.wait()
        self.assertEqual(group.drop_pending(), 1)

    def test_all_to_all_chunk_s_is_the_input_chunk_for_minus_s_including_functional_collectives(self) -> None:
        group = standin_group(4)
        x = torch.arange(10.0)
        in_splits = [1, 2, 3, 4]
        out_splits = [in_splits[(-s) % 4] for s in range(4)]  # [1, 4, 3, 2]
        want = torch.cat([x.split(in_splits)[(-s) % 4] for s in range(4)])
        out = torch.empty(10)
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
        self.assertTrue(torch.equal(out, want))
        got = funcol.wait_tensor(funcol.all_to_all_single(x, out_splits, in_splits, group))
        self.assertTrue(torch.equal(got, want))

    def test_all_to_all_splits_that_break_the_mirror_rule_are_refused(self) -> None:
        group = standin_group(4)
        with self.assertRaisesRegex(StandinError, "do not mirror input splits"):
            dist.all_to_all_single(torch.empty(10), torch.zeros(10), [1, 2, 3, 4], [1, 2, 3, 4], group=group)

    def test_gathers_repeat_this_rank_and_reductions_combine_n_copies(self) -> None:
        group = standin_group(3)
        row = torch.tensor([1, 2], dtype=torch.int64)
        out = torch.empty(6, dtype=torch.int64)
        dist.all_gather_into_tensor(out, row, group=group)
        self.assertEqual(out.tolist(), [1, 2, 1, 2, 1, 2])
        t = torch.tensor([2.0, -1.0])
        dist.all_reduce(t, group=group)
        self.assertEqual(t.tolist(), [6.0, -3.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        self.assertEqual(t.tolist(), [6.0, -3.0])
        summed = funcol.wait_tensor(funcol.all_reduce(torch.ones(2), "sum", group))
        self.assertEqual(summed.tolist(), [3.0, 3.0])

    def test_each_size_gets_its_own_cached_group_and_names_are_never_reused(self) -> None:
        g4, g8 = standin_group(4), standin_group(8)
        self.assertIsInstance(g4, StandinGroup)
        self.assertIs(standin_group(4), g4)
        self.assertEqual((dist.get_world_size(g4), dist.get_rank(g4), dist.get_world_size(g8)), (4, 0, 8))
        names = {g4.group_name, g8.group_name}
        destroy_standin_groups()
        self.assertFalse(dist.is_initialized())
        self.assertTrue(names.isdisjoint({standin_group(4).group_name, standin_group(8).group_name}))
        with self.assertRaisesRegex(ValueError, "size must be in"):
            standin_group(0)


H, F, K, T = 16, 8, 3, 24


def _inputs(world: int, e_l: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(world * e_l, generator=gen)[:K] for _ in range(T)])
    scores = torch.rand(T, K, generator=gen)
    w = moe_weights(seed, H, F, e_l)
    return x, ids, scores, [w["w1"], w["w2"], w["w3"]]


def _forward_backward(fn, x: Tensor, ids: Tensor, scores: Tensor, weights: list[Tensor], **kw) -> list[Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in (x, scores, *weights)]
    y = fn(leaves[0], ids, leaves[1], *leaves[2:], **kw)
    grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    return [y.detach(), *torch.autograd.grad(y, leaves, grad_y)]


def _dense_tied(world: int):
    """Dense reference where every partition's weights are this rank's: ``W[e] = W_local[e mod E_l]``."""

    def fn(x, ids, scores, w1, w2, w3):
        return dense_moe(x, ids, scores, w1.repeat(world, 1, 1), w2.repeat(world, 1, 1), w3.repeat(world, 1, 1))

    return fn


class MoEUnderTheStandinGroup(StandinTestCase):
    def assert_all_close(self, got: list[Tensor], want: list[Tensor], what: str) -> None:
        names = ["y", "dx", "d_scores", "dw1", "dw2", "dw3"]
        for name, g, w in zip(names, got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * w.abs().max().item(),
                                       msg=lambda m, n=name: f"{what}, {n}: {m}")

    def test_a2a_and_expert_routing_ring_equal_the_dense_layer_with_tied_partitions(self) -> None:
        for world, e_l in ((2, 2), (4, 2), (8, 1)):
            group = standin_group(world)
            x, ids, scores, weights = _inputs(world, e_l, seed=world)
            dense = _forward_backward(_dense_tied(world), x, ids, scores, weights)
            a2a = _forward_backward(a2a_moe, x, ids, scores, weights, group=group)
            self.assert_all_close(a2a, dense, f"a2a_moe at N={world}")
            for options in ({"overlap": True}, {"overlap": False}, {"max_hop_rows": 5}):
                ring = _forward_backward(ring_moe, x, ids, scores, weights, group=group, routing="expert", **options)
                self.assert_all_close(ring, a2a, f"ring_moe(expert, {options}) at N={world}")

    def test_token_routing_ring_computes_n_times_the_pairs_on_this_ranks_experts(self) -> None:
        # Every hop brings this rank's own tokens back to its own experts (module docstring of standin_group).
        world, e_l = 4, 2
        group = standin_group(world)
        x, ids, scores, weights = _inputs(world, e_l, seed=3)

        def model(x, ids, scores, w1, w2, w3):
            return world * _dense_tied(world)(x, ids, scores * (ids < e_l), w1, w2, w3)

        want = _forward_backward(model, x, ids, scores, weights)
        got = _forward_backward(ring_moe, x, ids, scores, weights, group=group, routing="token")
        self.assert_all_close(got, want, "ring_moe(token) at N=4")

    def test_compiled_rows_pass_the_group_by_name_and_equal_the_eager_a2a(self) -> None:
        # torch 2.11's Dynamo cannot proxy the stand-in group object (DESIGN.md section 6): the name goes in.
        world, e_l = 4, 2
        group = standin_group(world)
        cfg = LayerConfig(name="c", hidden=H, ffn=F, experts=world * e_l, top_k=K, tokens=T, ep=world,
                          dtype="fp32", device="cpu")
        x, ids, scores, weights = _inputs(world, e_l, seed=5)
        groups = []

        def spy(*args, **kwargs):
            groups.append(kwargs["group"])
            return a2a_moe(*args, **kwargs)

        with unittest.mock.patch.object(single_layer, "a2a_moe", spy):
            got = _forward_backward(single_layer._compiled_a2a("aot_eager")(cfg, group), x, ids, scores, weights)
        self.assertEqual(groups, [group.group_name])
        want = _forward_backward(a2a_moe, x, ids, scores, weights, group=group)
        self.assert_all_close(got, want, "a2a_moe compiled with the group's name")


class LinkModelTest(unittest.TestCase):
    def test_expert_routing_moves_the_partition_per_hop_and_overlap_hides_the_smaller_side(self) -> None:
        cfg = LayerConfig(name="m", hidden=2048, ffn=768, experts=128, top_k=8, tokens=65536, ep=8)
        ring = RowSpec(name="ring", build=_a2a_eager, kind="ring")
        m = link_model(cfg, ring, fwd_ms=8.0, bwd_ms=16.0, gbps=450.0)
        partition = 16 * 3 * 2048 * 768 * 2
        self.assertEqual((m.bytes_fwd, m.bytes_bwd, m.transfers_fwd, m.transfers_bwd), (partition, 2 * partition, 7, 8))
        t_fwd, t_bwd = partition / 450e6, 2 * partition / 450e6  # ms
        self.assertAlmostEqual(m.link_ms, 7 * t_fwd + 8 * t_bwd)
        self.assertAlmostEqual(m.total_ms, 7 * max(1.0, t_fwd) + 1.0 + 7 * max(2.0, t_bwd) + 2.0 + t_bwd)
        seq = link_model(cfg, RowSpec(name="s", build=_a2a_eager, kind="ring", overlap=False), 8.0, 16.0, 450.0)
        self.assertAlmostEqual(seq.total_ms, 24.0 + seq.link_ms)
        a2a = link_model(cfg, RowSpec(name="a", build=_a2a_eager, kind="a2a"), 8.0, 16.0, 450.0)
        self.assertEqual(a2a.bytes_fwd, 65536 * 8 * 2048 * 2 * 7 // 8)


class CudaSnapshotParsingTest(unittest.TestCase):
    def test_trace_events_become_a_level_series_without_the_backward_marker(self) -> None:
        # The shape of torch.cuda.memory._snapshot()["device_traces"][device] entries (CUDA only, so synthetic).
        marker = single_layer._MARKER_BYTES
        trace = [
            {"action": "segment_alloc", "addr": 0, "size": 1 << 21, "time_us": 1000},
            {"action": "alloc", "addr": 0, "size": 512, "time_us": 1000, "frames": [{"name": "f"}]},
            {"action": "alloc", "addr": 512, "size": 1024, "time_us": 2000},
            {"action": "alloc", "addr": 4096, "size": marker, "time_us": 3000},
            {"action": "free_requested", "addr": 4096, "size": marker, "time_us": 3000},
            {"action": "free_completed", "addr": 4096, "size": marker, "time_us": 3000},
            {"action": "free_requested", "addr": 0, "size": 512, "time_us": 4000},
            {"action": "free_completed", "addr": 0, "size": 512, "time_us": 4000},
        ]
        snapshot = {"device_traces": [trace], "segments": [{"blocks": [{"size": 512, "frames": [{"name": "f"}]}]}]}
        with unittest.mock.patch("torch.cuda.current_device", return_value=0):
            deltas = single_layer._cuda_trace_deltas(snapshot)
        times, levels, backward_at = single_layer._levels_without_marker(deltas)
        self.assertEqual(levels, [512, 1536, 1024])
        self.assertEqual(times, [0.0, 1.0, 3.0])
        self.assertEqual(backward_at, 2.0)
        stripped = single_layer._strip_frames(snapshot)
        self.assertNotIn("frames", stripped["device_traces"][0][1])
        self.assertNotIn("frames", stripped["segments"][0]["blocks"][0])
        self.assertIn("frames", snapshot["device_traces"][0][1])


class TinyPresetTest(StandinTestCase):
    def test_tiny_preset_writes_every_row_with_ratios_and_the_ring_peak_is_below_a2a(self) -> None:
        from relay_compile.bench.__main__ import main

        with tempfile.TemporaryDirectory() as tmp:
            self.assertEqual(main(["--preset", "tiny", "--out", tmp, "--repeats", "2", "--warmup", "1"]), 0)
            out = Path(tmp)
            data = json.loads((out / "results.json").read_text())
            md = (out / "results.md").read_text()
            if HAVE_MATPLOTLIB:
                self.assertTrue((out / "memory_timeline.png").stat().st_size > 10_000)

        sections = {s["title"]: s["layers"] for s in data["sections"]}
        main_rows = {r["row"]: r for r in sections["Tiny layer, all rows"][0]["rows"]}
        expected = {A2A_EAGER, "a2a inductor", "ring sequential", "ring overlap", "ring overlap, hops <= 256 rows",
                    "ring overlap, no grouped GEMM", "ring token routing"}
        self.assertLessEqual(expected, set(main_rows))
        self.assertIn("torch.compile rows are off", main_rows["a2a inductor"]["skipped"])
        a2a = main_rows[A2A_EAGER]
        self.assertEqual((a2a["time_ratio"], a2a["peak_ratio"]), (1.0, 1.0))
        for name in expected - {A2A_EAGER, "a2a inductor"}:
            row = main_rows[name]
            self.assertEqual(row["skipped"], "", name)
            self.assertAlmostEqual(row["time_ratio"], row["total_ms"] / a2a["total_ms"], msg=name)
            self.assertAlmostEqual(row["peak_ratio"], row["peak_bytes"] / a2a["peak_bytes"], msg=name)
            self.assertIsNotNone(row["model_ratio"], name)
            self.assertLess(row["peak_bytes"], a2a["peak_bytes"], f"{name} peak is not below a2a's")
            self.assertIn(f"| {name} |", md)
        self.assertIn("max |diff| / max |y|", sections["Tiny layer, all rows"][0]["check"])

        ablation = [r["row"] for r in sections["Ablation (paper Figure 17)"][0]["rows"]]
        self.assertEqual(ablation[:4], [A2A_EAGER, "ring sequential, no grouped GEMM",
                                        "ring overlap, no grouped GEMM", "ring overlap + grouped GEMM"])
        capacity = {c["row"]: c["max_tokens"] for c in data["capacity"]}
        self.assertGreater(capacity["ring overlap"], capacity[A2A_EAGER])
        self.assertGreater(capacity[A2A_EAGER], 0)
        timelines = {t["row"]: t for t in data["timelines"]}
        self.assertLess(timelines["ring overlap"]["peak_bytes"], timelines[A2A_EAGER]["peak_bytes"])
        self.assertIsNotNone(timelines[A2A_EAGER]["backward_starts_ms"])

    def test_an_extra_row_joins_the_table_and_a_failing_row_keeps_its_place(self) -> None:
        cfg = LayerConfig(name="x", hidden=16, ffn=8, experts=8, top_k=2, tokens=64, ep=2, dtype="fp32", device="cpu")

        def broken(cfg, group):
            raise RuntimeError("backend exploded")

        rows = [RowSpec(name=A2A_EAGER, build=_a2a_eager, kind="a2a"),
                RowSpec(name="broken", build=broken, kind="ring")]
        extra = RowSpec(name="again", build=_a2a_eager, kind="a2a")
        res = measure_layer(cfg, BenchOptions(warmup=0, repeats=1), rows, extra_rows=[extra])
        self.assertEqual([r.row for r in res.rows], [A2A_EAGER, "broken", "again"])
        self.assertIn("backend exploded", res.row("broken").skipped)
        self.assertIsNotNone(res.row("again").time_ratio)

    def test_capacity_search_finds_the_largest_multiple_of_step_under_the_budget(self) -> None:
        cfg = LayerConfig(name="c", hidden=16, ffn=8, experts=8, top_k=2, tokens=256, ep=2, dtype="fp32",
                          device="cpu")
        spec = RowSpec(name=A2A_EAGER, build=_a2a_eager, kind="a2a")
        res = capacity_search(cfg, spec, 200_000, step=64, max_tokens=4096)
        fitting = [t for t, b in res.probes if b is not None and b <= 200_000]
        over = [t for t, b in res.probes if b is None or b > 200_000]
        self.assertEqual(res.max_tokens, max(fitting))
        self.assertEqual(min(over), res.max_tokens + 64)
        self.assertFalse(res.limited_by_search)


if __name__ == "__main__":
    unittest.main()

"""The backend's report: the peak-memory model, the routing decision per region, summary, JSON and dumps.

Expected numbers are worked out by hand below from the formulas in ``report``'s and ``routing``'s docstrings.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import unittest

from relay_compile.report import BlockShape, GraphDump, GraphReport, RegionReport, predicted_peak_bytes

MiB = 2**20

# P = 10*2 = 20 pairs, 4 ranks; a packed row (2H + params/H) * elem = (8 + 50 // 4) * 2 = 40 bytes.
#   a2a  = P * (6H + 4F) * elem                              = 20 * (24 + 24) * 2     = 1920
#   ring = the backward's (the forward holds less: y's fp32 sum, rows, two partitions  = 960):
#          dx's fp32 sum and its bf16 result T*H*(4 + 2)   = 40 * 6                  = 240
#          + hop rows ceil(20 / 4) = 5 * 40                                           = 200
#          + partitions (2 weights, 2 fp32 sums = 4, 1 returned) 7 * E_l*expert_bytes = 7 * 300 = 2100 -> 2540
SMALL = BlockShape(tokens=10, hidden=4, ffn=6, top_k=2, experts_per_rank=3, group_size=4, elem_bytes=2,
                   expert_bytes=100)
# Per hop, (forward, backward):
#   expert: E_l*expert_bytes = 300, twice that with the gradients = 600                  -> 900
#   token:  metadata K*(8 + elem) = 20 per token, row H*elem = 8
#           forward 10*(8 + 20) + 10*8 = 360; backward 10*(16 + 20) + 10*(8 + 2*2) = 480  -> 840: token
SMALL_VOLUMES = {"expert": {"forward": 300, "backward": 600}, "token": {"forward": 360, "backward": 480}}

# report.py's reference shape (world 4, T=4096, H=256, F=128, E=16, K=8, fp32), swiglu experts:
#   expert_bytes = 3*F*H*4 = 393216; P = 32768; a packed row (2H + 3F) * 4 = 3584 bytes
#   a2a  = 32768 * (1536 + 512) * 4                               = 268435456 = 256 MiB
#   ring = backward: T*H*(4 + 4) = 8 MiB, 8192 hop rows * 3584 = 28 MiB, partitions (fp32 sums as wide as the
#          weights) 5 * 4 * 393216 = 7.5 MiB                      -> 43.5 MiB; with max_hop_rows=1024: 19 MiB
#   expert routing per hop 1.5 MiB + 3 MiB, token routing 4096*2144 + 4096*3200 bytes (~20.9 MiB): expert
REFERENCE = BlockShape(tokens=4096, hidden=256, ffn=128, top_k=8, experts_per_rank=4, group_size=4, elem_bytes=4,
                       expert_bytes=393216)
# One more owner in a forward hop of REFERENCE (ring_options.stack_extra_bytes): 8192 rows of the packed widths
# (2H + 3F) * 4 bytes = 3584, and two partitions of 4 * 393216 bytes: 29360128 + 3145728 = 31 MiB.
REFERENCE_OWNER_BYTES = 32505856


class PeakMemoryModel(unittest.TestCase):
    def test_a_small_block_matches_the_hand_computed_peaks(self) -> None:
        self.assertEqual(predicted_peak_bytes(SMALL), {"a2a": 1920, "ring": 2540})

    def test_max_hop_rows_below_the_hop_bounds_the_ring_and_leaves_the_a2a_alone(self) -> None:
        # 3 rows instead of 5: 2540 - 2 * 40 = 2460.
        self.assertEqual(predicted_peak_bytes(SMALL, max_hop_rows=3), {"a2a": 1920, "ring": 2460})

    def test_max_hop_rows_above_the_hop_or_zero_changes_nothing(self) -> None:
        for bound in (0, 5, 8, 10_000):
            self.assertEqual(predicted_peak_bytes(SMALL, max_hop_rows=bound), {"a2a": 1920, "ring": 2540}, bound)

    def test_hop_rows_round_up_when_the_pairs_do_not_divide_by_the_ring(self) -> None:
        # K=1: P = 10, ceil(10 / 4) = 3 rows: ring 2540 - 2 * 40 = 2460; a2a 10 * 48 * 2 = 960.
        shape = dataclasses.replace(SMALL, top_k=1)
        self.assertEqual(predicted_peak_bytes(shape), {"a2a": 960, "ring": 2460})

    def test_the_reference_shape_predicts_256_mib_for_the_a2a_and_43_5_for_the_ring(self) -> None:
        self.assertEqual(predicted_peak_bytes(REFERENCE), {"a2a": 256 * MiB, "ring": 87 * MiB // 2})
        self.assertEqual(predicted_peak_bytes(REFERENCE, 1024), {"a2a": 256 * MiB, "ring": 19 * MiB})

    def test_owners_per_hop_add_their_stacks_to_the_direction_that_holds_them(self) -> None:
        # The forward holds y's fp32 sum (4 MiB), its hop's rows (28 MiB) and two partitions (3 MiB): 35 MiB.
        ring, forward = predicted_peak_bytes(REFERENCE)["ring"], 35 * MiB
        self.assertEqual(predicted_peak_bytes(REFERENCE, owners=(2, 1))["ring"], forward + REFERENCE_OWNER_BYTES)
        # A backward owner: 8192 rows at twice a forward row's bytes and six partitions, added to the backward's.
        backward = 8192 * 3584 * 2 + 6 * 4 * 393216
        self.assertEqual(predicted_peak_bytes(REFERENCE, owners=(1, 2))["ring"], ring + backward)
        self.assertEqual(predicted_peak_bytes(REFERENCE, owners=(4, 2))["ring"], forward + 3 * REFERENCE_OWNER_BYTES)

    def test_weight_gradients_count_by_elements_whatever_bytes_the_weights_circulate_in(self) -> None:
        # FP8 hops (runtime.fp8_experts) circulate one byte a weight (and a scale per matrix), but the gradients are
        # summed in fp32 and returned in the tokens' dtype: only the two circulating partitions shrink.
        bf16 = dataclasses.replace(REFERENCE, elem_bytes=2, expert_bytes=3 * 128 * 256 * 2)
        fp8 = dataclasses.replace(bf16, expert_bytes=3 * 128 * 256 + 3 * 4, expert_params=3 * 128 * 256)
        circulating = 2 * 4 * (bf16.expert_bytes - fp8.expert_bytes)
        self.assertEqual(predicted_peak_bytes(bf16, 1024)["ring"] - predicted_peak_bytes(fp8, 1024)["ring"], circulating)

    def test_the_token_ring_holds_the_visiting_tokens_and_their_sums_not_the_expert_partitions(self) -> None:
        # REFERENCE, token routing, backward: x and dy (computed and arriving) 2 * (2 * 4 MiB + 4096 * 8 * 12), dx's
        # sums (sent and arriving) 2 * 4 MiB and its result 4 MiB, the hop's rows 28 MiB, this rank's experts'
        # fp32 weight-gradient sums and their result 2 * 1.5 MiB.
        routing = 4096 * 8 * 12
        backward = 2 * (8 * MiB + routing) + 8 * MiB + 4 * MiB + 28 * MiB + 3 * MiB
        self.assertEqual(predicted_peak_bytes(REFERENCE, routing="token")["ring"], backward)


class MatchedRegion(unittest.TestCase):
    def test_auto_routing_records_the_predicted_mode_with_both_modes_volumes(self) -> None:
        r = RegionReport.matched(2, "all_to_all_single_1", "ep0", SMALL, "auto", 3, fp32_accumulation=False)
        self.assertEqual((r.index, r.status, r.anchor, r.group_name, r.group_size), (2, "matched",
                         "all_to_all_single_1", "ep0", 4))
        self.assertEqual((r.routing_option, r.routing_predicted), ("auto", "token"))
        self.assertEqual(r.per_hop_bytes, SMALL_VOLUMES)
        # The model's choice on the H200 constants is the expert ring (routing_predicted is by bytes per hop): its
        # peak, the backward's with 3-row chunks, 2540 - 2 * 40 (the memory model sums in fp32 either way).
        self.assertEqual(r.predicted_peak_bytes, {"a2a": 1920, "ring": 2460})
        self.assertEqual(r.shape["tokens"], 10)
        self.assertEqual(r.shape["expert_bytes"], 100)
        self.assertEqual(set(r.shape), {f.name for f in dataclasses.fields(BlockShape)})
        self.assertEqual((r.reason, r.ring_op), ("", ""))

    def test_auto_picks_expert_routing_when_the_experts_are_the_smaller_payload(self) -> None:
        # expert_bytes 10: 30 + 60 = 90 per hop against token routing's 840.
        r = RegionReport.matched(0, "a", "ep0", dataclasses.replace(SMALL, expert_bytes=10), "auto", 0,
                                 fp32_accumulation=False)
        self.assertEqual(r.routing_predicted, "expert")
        self.assertEqual(r.per_hop_bytes["expert"], {"forward": 30, "backward": 60})

    def test_auto_breaks_a_tie_toward_expert_routing(self) -> None:
        # One expert of 280 bytes: 280 + 560 = 840, the same as token routing.
        r = RegionReport.matched(0, "a", "ep0", dataclasses.replace(SMALL, experts_per_rank=1, expert_bytes=280),
                                 "auto", 0, fp32_accumulation=False)
        self.assertEqual(sum(r.per_hop_bytes["expert"].values()), sum(r.per_hop_bytes["token"].values()))
        self.assertEqual(r.routing_predicted, "expert")

    def test_fp32_accumulation_sends_the_sums_in_fp32(self) -> None:
        # bf16 weights of 100 bytes -> gradients of 200: expert backward 300 + 3 * 200 = 900.
        # Token rows of sums H*4 = 16: forward 10*(8 + 20) + 10*16 = 440; backward 10*(16 + 20) + 10*(16 + 2*2) = 560.
        r = RegionReport.matched(0, "a", "ep0", SMALL, "auto", 0)
        self.assertEqual(r.per_hop_bytes, {"expert": {"forward": 300, "backward": 900},
                                           "token": {"forward": 440, "backward": 560}})
        self.assertEqual(r.routing_predicted, "token")  # 1200 against 1000

        self.assertEqual(RegionReport.matched(0, "a", "ep0", SMALL, "expert", 0).routing_predicted, "expert")
        cheap_experts = dataclasses.replace(SMALL, expert_bytes=10)
        r = RegionReport.matched(0, "a", "ep0", cheap_experts, "token", 0)
        self.assertEqual((r.routing_option, r.routing_predicted), ("token", "token"))


def sample_report() -> GraphReport:
    refused = RegionReport(index=0, status="refused", anchor="all_to_all_single", reason="no token all-to-all pair")
    rewritten = RegionReport.matched(1, "all_to_all_single_2", "ep0", REFERENCE, "auto", 0)
    rewritten.status, rewritten.ring_op = "rewritten", "relaymoe.ring_moe"
    matched = RegionReport.matched(2, "all_to_all_single_5", "ep0", REFERENCE, "token", 1024)
    return GraphReport(graph="graph3", rank=1, options={"routing": "auto", "max_hop_rows": 0, "remat": True},
                       regions=[refused, rewritten, matched], pass_seconds={"match": 0.25, "rewrite": 0.5},
                       dumps=["/tmp/x/report.json"])


class Summary(unittest.TestCase):
    def test_one_line_per_region_with_refusals_and_predicted_peaks(self) -> None:
        self.assertEqual(sample_report().summary().split("\n"), [
            "graph3 (rank 1): 3 MoE region(s)",
            "  region 0 at all_to_all_single: refused: no token all-to-all pair",
            # 256 / (35 + 31) = 3.88: the forward with its second owner per hop (REFERENCE_OWNER_BYTES)
            "  region 1 at all_to_all_single_2: rewritten, EP=4, routing auto -> expert, predicted peak a2a "
            "256.0 MiB, ring 66.0 MiB (3.9x)",
            # The owners per hop the op will hold (grouped experts, cost_model.owner_options), not one.
            # Against the all-to-all a kept region runs: compiled, kept_a2a_ratio(4) (EP=8's: 0.984, the smallest
            # group measured) of a2a eager's 5.42 ms.
            "    runs as expert: expert ring (2/1 owners per forward/backward hop): predicted 2.77 ms against the "
            "kept all-to-all's 5.33 ms (h200 model: on CUDA)",
            # The token ring's backward with 1024-row chunks (test_the_token_ring_holds_...): 2 * (8 MiB + 384 KiB)
            # + 8 + 4 + 3.5 + 3 = 35.25 MiB; 256 / 35.25 = 7.26
            "  region 2 at all_to_all_single_5: matched, EP=4, routing token -> token, predicted peak a2a "
            "256.0 MiB, ring 35.2 MiB (7.3x)",
            "    runs as all_to_all: the token ring is predicted slower (16.67 ms against the kept all-to-all's "
            "5.33 ms; "
            "peak 35 MiB against 256 MiB); ring='memory' or 'always' runs it (h200 model: on CUDA)",
        ])

    def test_a_graph_without_regions_is_one_line(self) -> None:
        self.assertEqual(GraphReport(graph="graph0", rank=0, options={}).summary(), "graph0 (rank 0): 0 MoE region(s)")


class Json(unittest.TestCase):
    def test_the_json_holds_every_field_and_rebuilds_the_same_report(self) -> None:
        report = sample_report()
        loaded = json.loads(report.to_json())
        self.assertEqual((loaded["graph"], loaded["rank"]), ("graph3", 1))
        self.assertEqual(loaded["options"], {"routing": "auto", "max_hop_rows": 0, "remat": True})
        self.assertEqual(loaded["pass_seconds"], {"match": 0.25, "rewrite": 0.5})
        self.assertEqual(loaded["dumps"], ["/tmp/x/report.json"])
        regions = loaded["regions"]
        self.assertEqual([r["status"] for r in regions], ["refused", "rewritten", "matched"])
        self.assertEqual(regions[0]["reason"], "no token all-to-all pair")
        self.assertEqual(regions[1]["predicted_peak_bytes"], {"a2a": 268435456, "ring": 35 * MiB + REFERENCE_OWNER_BYTES})
        self.assertEqual(regions[1]["per_hop_bytes"]["expert"], {"forward": 1572864, "backward": 3145728})
        self.assertEqual(regions[2]["shape"]["tokens"], 4096)
        rebuilt = GraphReport(**{**loaded, "regions": [RegionReport(**r) for r in regions]})
        self.assertEqual(rebuilt, report)


class Dumps(unittest.TestCase):
    def test_without_a_dump_dir_nothing_is_written(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            cwd = os.getcwd()
            os.chdir(tmp)
            try:
                dump = GraphDump("", "graph0", 0)
                dump.write("0_dynamo_graph.py", "print(1)\n", header="before")
            finally:
                os.chdir(cwd)
            self.assertIsNone(dump.dir)
            self.assertEqual(dump.files, [])
            self.assertEqual(os.listdir(tmp), [])

    def test_with_a_dump_dir_each_graph_and_rank_gets_its_folder_and_files_keep_their_headers(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            root = os.path.join(tmp, "not", "yet")  # created on demand
            dump = GraphDump(root, "graph2", 3)
            folder = os.path.join(root, "graph2_rank3")
            self.assertTrue(os.path.isdir(folder))
            dump.write("a.py", "x = 1\n", header="Dynamo graph")
            dump.write("report.json", "{}")
            self.assertEqual(dump.files, [os.path.join(folder, "a.py"), os.path.join(folder, "report.json")])
            with open(os.path.join(folder, "a.py")) as f:
                self.assertEqual(f.read(), "# Dynamo graph\nx = 1\n")
            with open(os.path.join(folder, "report.json")) as f:
                self.assertEqual(f.read(), "{}")
            self.assertEqual(sorted(os.listdir(folder)), ["a.py", "report.json"])


if __name__ == "__main__":
    unittest.main()

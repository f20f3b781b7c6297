"""``RingOptions`` and ring specs: validation in one place, one key for every entry point, no processes."""

from __future__ import annotations

import unittest

import torch

from relay_compile import config
from relay_compile.experts import ffn_expert_fn
from relay_compile.options import resolve
from relay_compile.runtime.ring_options import (
    AUTO_FORWARD_ROWS_FACTOR,
    AUTO_MIN_HOP_ROWS,
    HopShape,
    InvalidRingOption,
    RingOptions,
    backward_owners_per_hop,
    token_backward_partitions_per_hop,
    token_partitions_per_hop,
    hop_row_bound,
    owners_per_hop,
)
from relay_compile.runtime.specs import RingSpec, register_spec, spec_state


class RingOptionsAreValidatedOnce(unittest.TestCase):
    def test_defaults_are_the_overlapped_rematerialized_auto_ring_with_auto_bounded_hops(self) -> None:
        self.assertEqual(RingOptions(), RingOptions(routing="auto", overlap=True, remat=True, max_hop_rows="auto",
                                                    fp32_accumulation=True))

    def test_bad_values_name_the_option_and_what_is_valid(self) -> None:
        cases = [
            (dict(routing="ring"), r"^routing='ring' is not one of \('auto', 'expert', 'token'\)$"),
            (dict(max_hop_rows=0), r"^max_hop_rows must be a positive row count, 'auto' or None, got 0$"),
            (dict(max_hop_rows=True), r"max_hop_rows must be a positive row count, 'auto' or None, got True"),
            (dict(max_hop_rows=2.5), r"max_hop_rows must be a positive row count, 'auto' or None, got 2.5"),
            (dict(overlap=1), r"^overlap must be a bool, got 1$"),
            (dict(fp32_accumulation="yes"), r"^fp32_accumulation must be a bool, got 'yes'$"),
        ]
        for values, message in cases:
            with self.subTest(values=values), self.assertRaisesRegex(InvalidRingOption, message):
                RingOptions(**values)

    def test_each_entry_point_prefixes_the_problem_with_its_own_name(self) -> None:
        with self.assertRaisesRegex(ValueError, r"^ring_moe: routing='x' is not one of"):
            RingOptions.checked("ring_moe", routing="x")
        with self.assertRaisesRegex(ValueError, r"^rewrite: max_hop_rows must be a positive row count"):
            RingOptions.checked("rewrite", max_hop_rows=-3)
        with self.assertRaisesRegex(ValueError, r"^relaymoe: option routing='x' is not one of"):
            resolve({"routing": "x"})

    def test_the_config_spells_no_bound_as_zero_and_the_ring_as_none(self) -> None:
        with config.patch(max_hop_rows=0):
            self.assertIsNone(resolve().ring.max_hop_rows)
        self.assertEqual(resolve({"max_hop_rows": 256}).ring.max_hop_rows, 256)
        with self.assertRaisesRegex(ValueError, r"option max_hop_rows=-1 must be >= 0"):
            resolve({"max_hop_rows": -1})

    def test_auto_bounds_a_chunk_to_a_quarter_of_the_tokens_and_never_below_the_minimum(self) -> None:
        self.assertEqual(hop_row_bound("auto", 65536), max(16384, AUTO_MIN_HOP_ROWS))
        self.assertEqual(hop_row_bound("auto", 1 << 20), 1 << 18)
        self.assertEqual(hop_row_bound("auto", 128), AUTO_MIN_HOP_ROWS)
        self.assertIsNone(hop_row_bound(None, 1 << 20))
        self.assertEqual(hop_row_bound(64, 1 << 20), 64)

    def test_auto_lets_a_forward_chunk_hold_twice_the_rows_and_an_explicit_bound_holds_both_ways(self) -> None:
        self.assertEqual(hop_row_bound("auto", 65536, forward=True), 2 * hop_row_bound("auto", 65536))
        self.assertEqual(hop_row_bound(64, 1 << 20, forward=True), 64)
        self.assertIsNone(hop_row_bound(None, 1 << 20, forward=True))

    @staticmethod
    def owners(ranks: int, tokens: int, top_k: int = 8, hidden: int = 2048, ffn: int = 768, experts: int = 128,
               elem_bytes: int = 2, other_tokens: int | None = None) -> int:
        """The rule for a SwiGLU layer (w1, w2, w3 of E_l experts), every rank ``tokens`` (one ``other_tokens``)."""
        e_l = experts // ranks
        weights = [((e_l, ffn, hidden), e_l * ffn * hidden * elem_bytes), ((e_l, hidden, ffn), e_l * ffn * hidden
                   * elem_bytes), ((e_l, ffn, hidden), e_l * ffn * hidden * elem_bytes)]
        tokens_N = [tokens] * (ranks - 1) + [tokens if other_tokens is None else other_tokens]
        return owners_per_hop(HopShape.of(ranks, tokens_N, top_k, weights, hidden, elem_bytes))

    def test_hop_shape_reads_the_stacked_matrices_widths_and_counts_everything_in_the_partition(self) -> None:
        # Packed SwiGLU (w13 (E_l, 2F, H), w2 (E_l, H, F)) and a bias (E_l, 2F): rows 2F+H + H+F wide, in bf16.
        shape = HopShape.of(64, [100, 300], 8, [((2, 16, 8), 512), ((2, 8, 8), 256), ((2, 16), 64)], 8, 2)
        self.assertEqual((shape.row_bytes, shape.partition_bytes, shape.token_bytes), ((24 + 16) * 2, 832, 16))
        self.assertEqual((shape.max_tokens, shape.min_tokens), (300, 100))

    def test_owners_per_hop_groups_small_hops_where_the_backward_holds_more_than_the_stack_adds(self) -> None:
        # Qwen3 layer, 65536 tokens, K=8, bf16: hops of 8192 rows at EP=64 go in pairs, 4096 at EP=128 in fours,
        # EP=8's 65536-row and EP=32's 16384-row hops alone.
        self.assertEqual([self.owners(n, 65536) for n in (8, 32, 64, 128)], [1, 1, 2, 4])
        # Memory: the pair's extra 8192 rows and two partitions (~176 MB) must fit in one expanded buffer of the
        # smallest rank (T*K*H*2 bytes): with 16384 tokens on one rank (512 MiB), not with 2048 (64 MiB), nor at 4
        # ranks with top-8 routing (the CPU three_styles shapes: hops of 2T rows).
        self.assertEqual(self.owners(64, 65536, other_tokens=16384), 2)
        self.assertEqual(self.owners(64, 65536, other_tokens=2048), 1)
        # Smaller hops go in larger groups: 16384 tokens at EP=64 (2048-row hops) in eights, 32768 in fours.
        self.assertEqual([self.owners(64, t) for t in (16384, 32768)], [8, 4])
        self.assertEqual(self.owners(4, 4096, hidden=256, ffn=128, experts=16, elem_bytes=4), 1)
        # Powers of two dividing the ring, at most half of it (narrow experts, top-1: memory allows any of them).
        self.assertEqual([self.owners(n, 8192, top_k=1, hidden=256, ffn=16, experts=n) for n in (2, 3, 4, 6, 12, 7)],
                         [1, 1, 2, 2, 4, 1])
        hop_rows = 65536 * 8 // 64
        self.assertLessEqual(self.owners(64, 65536) * hop_rows, AUTO_MIN_HOP_ROWS)

    def test_token_routing_stacks_sources_only_where_their_whole_partitions_fit_one_expanded_buffer(self) -> None:
        def sources(ranks: int, tokens: int, top_k: int = 8, hidden: int = 2048, other_tokens: int | None = None,
                    ) -> tuple[int, int]:
            e_l = 128 // ranks  # Qwen3 SwiGLU, packed, bf16
            weights = [((e_l, 1536, hidden), e_l * 1536 * hidden * 2), ((e_l, hidden, 768), e_l * 768 * hidden * 2)]
            tokens_N = [tokens] * (ranks - 1) + [tokens if other_tokens is None else other_tokens]
            shape = HopShape.of(ranks, tokens_N, top_k, weights, hidden, 2)
            return token_partitions_per_hop(shape), token_backward_partitions_per_hop(shape)

        # A source more holds its whole tokens and their fp32 sums twice (~12 T H bytes in bf16) against the
        # budget's 2 K T H = 16 T H: one more fits a forward hop, none a backward hop (dy and dx too).
        self.assertEqual([sources(64, t) for t in (2048, 8192, 32768)], [(2, 1)] * 3)
        self.assertEqual(sources(16, 32768), (1, 1))  # 2 x 16384-row hops would pass AUTO_MIN_HOP_ROWS
        self.assertEqual(sources(8, 4096), (1, 1))  # EP=8: a hop's R = T rows (about 26 MB more) tips it over
        self.assertEqual(sources(64, 8192, other_tokens=4096), (1, 1))  # the smallest rank's buffer bounds it
        # Top-1 routing: the budget is one partition's tokens; nothing stacks.
        self.assertEqual(sources(64, 8192, top_k=1), (1, 1))
        # Wide top-k (K=32: budget 64 T H): four sources forward, two backward.
        self.assertEqual(sources(64, 1024, top_k=32), (4, 2))

    def test_backward_owners_group_hops_under_half_the_auto_rows_within_one_expanded_buffer(self) -> None:
        def backward(ranks: int, tokens: int, top_k: int = 8, hidden: int = 2048, ffn: int = 768,
                     experts: int = 128, other_tokens: int | None = None) -> int:
            # SwiGLU as the ring circulates it, packed: w13 (E_l, 2F, H), w2 (E_l, H, F); bf16.
            e_l = experts // ranks
            weights = [((e_l, 2 * ffn, hidden), e_l * 2 * ffn * hidden * 2), ((e_l, hidden, ffn), e_l * ffn * hidden * 2)]
            tokens_N = [tokens] * (ranks - 1) + [tokens if other_tokens is None else other_tokens]
            return backward_owners_per_hop(HopShape.of(ranks, tokens_N, top_k, weights, hidden, 2))

        # Qwen3 layer, bf16: EP=64 hops of 2048 rows (16384 tokens) go in fours, 4096 in pairs, 8192 alone (their
        # peak stays the plain ring's); EP=8's hops are large or their partitions too (16 experts, 151 MB each).
        self.assertEqual([backward(64, t) for t in (16384, 32768, 65536, 131072)], [4, 2, 1, 1])
        self.assertEqual([backward(8, t) for t in (4096, 16384, 65536)], [1, 1, 1])
        hop_rows = 16384 * 8 // 64
        self.assertLessEqual(backward(64, 16384) * hop_rows, AUTO_MIN_HOP_ROWS // AUTO_FORWARD_ROWS_FACTOR)
        # Memory: the smallest rank's expanded buffer bounds it (1024 tokens: 16 MiB, less than one owner more).
        self.assertEqual(backward(64, 16384, other_tokens=1024), 1)
        # Powers of two dividing the ring, at most half of it, where memory allows: an owner more holds its rows
        # (about 6 (H + F) bytes each, twice for a backward row) against the expanded buffer's K * H * 2 per token,
        # so g - 1 stays within ~N / 6 with narrow experts.
        self.assertEqual([backward(n, 1024, hidden=256, ffn=16, experts=n) for n in (2, 3, 4, 6, 12, 24, 7, 64)],
                         [1, 1, 1, 2, 2, 4, 1, 8])

    def test_the_key_spells_every_field(self) -> None:
        key = RingOptions(routing="token", overlap=False, remat=True, max_hop_rows=64, fp32_accumulation=False,
                          chunk_graphs="auto", ring="memory").key()
        self.assertEqual(key, "routing=token|overlap=0|remat=1|max_hop_rows=64|fp32_accumulation=0|chunk_graphs=auto"
                              "|ring=memory")
        self.assertTrue(RingOptions(chunk_graphs=True).key().endswith("|chunk_graphs=1|ring=auto"))
        with self.assertRaisesRegex(InvalidRingOption, r"ring='sometimes' is not one of \('auto', 'memory'"):
            RingOptions(ring="sometimes")

    def test_chunk_graphs_takes_a_bool_or_auto_and_auto_means_cuda(self) -> None:
        with self.assertRaisesRegex(InvalidRingOption, "chunk_graphs must be True, False or 'auto'"):
            RingOptions(chunk_graphs="yes")  # type: ignore[arg-type]
        self.assertTrue(RingOptions(chunk_graphs="auto").graphs_on(torch.device("cuda")))
        self.assertFalse(RingOptions(chunk_graphs="auto").graphs_on(torch.device("cpu")))
        self.assertTrue(RingOptions(chunk_graphs=True).graphs_on(torch.device("cpu")))
        self.assertFalse(RingOptions().graphs_on(torch.device("cuda")))
        self.assertEqual(resolve({"chunk_graphs": "auto"}).ring.chunk_graphs, "auto")
        with config.patch(chunk_graphs="true"):  # as RELAYMOE_CHUNK_GRAPHS=true reads
            self.assertIs(resolve().ring.chunk_graphs, True)
        with self.assertRaisesRegex(ValueError, "chunk_graphs='on' must be a bool"):
            resolve({"chunk_graphs": "on"})


SWIGLU = ffn_expert_fn("swiglu")


class RingSpecsAreKeyedByTheirContents(unittest.TestCase):
    def spec(self, routing: str = "auto", max_hop_rows: int | None = None) -> RingSpec:
        return RingSpec(expert_fn=SWIGLU, experts_per_rank=2, group_name="",
                        options=RingOptions(routing=routing, max_hop_rows=max_hop_rows))

    def test_equal_specs_share_one_key_and_one_registration(self) -> None:
        key = register_spec(self.spec(max_hop_rows=7), "ffn_test")
        self.assertEqual(key, "ffn_test|group=|E_l=2|scores=after|routing=auto|overlap=1|remat=1|max_hop_rows=7|fp32_accumulation=1|chunk_graphs=0|ring=auto")
        self.assertEqual(register_spec(self.spec(max_hop_rows=7), "ffn_test"), key)
        self.assertEqual(spec_state(key).ring.size, 1)

    def test_a_different_spec_under_the_same_name_and_options_is_refused(self) -> None:
        key = register_spec(self.spec(routing="token"), "ffn_conflict")
        other = RingSpec(expert_fn=ffn_expert_fn("silu"), experts_per_rank=2, group_name="",
                         options=RingOptions(routing="token", max_hop_rows=None))
        with self.assertRaisesRegex(ValueError, "already registered with other settings"):
            register_spec(other, "ffn_conflict")
        self.assertIs(spec_state(key).spec.expert_fn, SWIGLU)

    def test_an_unknown_key_names_itself(self) -> None:
        with self.assertRaisesRegex(KeyError, "no ring spec 'nope' registered in this process"):
            spec_state("nope")

    def test_circulating_weights_follow_the_expert_functions_packing(self) -> None:
        self.assertEqual(self.spec().circulating_weights(3), 2)  # swiglu: [w1|w3], w2
        silu = RingSpec(expert_fn=ffn_expert_fn("silu"), experts_per_rank=2, group_name="", options=RingOptions())
        self.assertEqual(silu.circulating_weights(2), 2)
        plain = RingSpec(expert_fn=lambda x, c, s, w: x, experts_per_rank=2, group_name="", options=RingOptions())
        self.assertEqual(plain.circulating_weights(5), 5)
        # What the packing promises is what it makes.
        w = [torch.zeros(2, 3, 4), torch.zeros(2, 4, 3), torch.zeros(2, 3, 4)]
        self.assertEqual(len(ffn_expert_fn("swiglu").pack(w)), self.spec().circulating_weights(3))


if __name__ == "__main__":
    unittest.main()

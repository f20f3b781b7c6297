"""Peak memory measurement on CPU is exact for known allocation sequences, and under gloo collectives."""

from __future__ import annotations

import shutil
import time
import unittest

import torch
import torch.distributed as dist
from torch.utils.cpp_extension import is_ninja_available

from relay_compile.memory import (
    PeakMemory,
    install_counting_cpu_allocator,
    measure_peak,
    memory_events,
    memory_timeline,
)
from relay_compile.reference import a2a_moe, moe_weights, qwen3_route
from tests.distributed import DistributedTestCase

# The counting allocator is a C++ extension built on first use (about a minute, then cached).
CAN_BUILD = shutil.which("c++") is not None and is_ninja_available()
needs_build = unittest.skipUnless(CAN_BUILD, "the counting CPU allocator needs a C++ compiler and ninja")


class PeakMemoryTest(unittest.TestCase):
    def test_cpu_peak_and_end_are_the_exact_bytes_above_entry(self) -> None:
        with PeakMemory("cpu") as mem:
            a = torch.empty(1000)
            b = torch.empty(2000)
            del a
            c = torch.empty(500)
        self.assertEqual((mem.peak_bytes, mem.end_bytes), (12000, 10000))
        del b, c

    def test_cpu_frees_of_memory_allocated_before_entry_are_not_seen(self) -> None:
        # The profiler cannot size a block it did not see allocated: the CPU level is an upper bound.
        before = torch.empty(4096)
        with PeakMemory("cpu") as mem:
            del before
            after = torch.empty(256)
        self.assertEqual((mem.peak_bytes, mem.end_bytes), (1024, 1024))
        del after

    def test_measure_peak_returns_the_result_and_the_peak(self) -> None:
        result, peak = measure_peak(lambda n: torch.ones(n).sum(), 100, device="cpu")
        self.assertEqual(result.item(), 100.0)
        self.assertEqual(peak, 400 + 4)  # ones(100), then the 0-dim sum

    def test_memory_timeline_is_a_step_function_whose_maximum_is_the_peak(self) -> None:
        def step() -> None:
            a = torch.empty(1000)
            b = torch.empty(2000)
            del a, b

        times_s, bytes_ = memory_timeline(step, device="cpu")
        self.assertEqual(bytes_, [0, 4000, 12000, 8000, 0])
        self.assertEqual(times_s, sorted(times_s))
        self.assertEqual(times_s[0], 0.0)

    def test_memory_events_are_signed_sizes_in_time_order_and_the_cpu_always_uses_the_profiler(self) -> None:
        def step() -> None:
            a = torch.empty(1000)
            b = torch.empty(2000)
            del a, b

        events = memory_events(step, device="cpu", cuda_source="history")  # "history" is CUDA's only
        self.assertEqual(events.nbytes, [4000, 8000, -4000, -8000])
        self.assertEqual(events.levels(), [4000, 12000, 8000, 0])
        self.assertEqual(events.times_ns, sorted(events.times_ns))
        self.assertIsNone(events.snapshot)
        with self.assertRaisesRegex(ValueError, "memory_events: cuda_source='trace' is not one of"):
            memory_events(step, device="cpu", cuda_source="trace")  # type: ignore[arg-type]

    def test_a2a_moe_forward_and_backward_peak_holds_the_expanded_buffer(self) -> None:
        num_tokens, hidden, top_k = 64, 16, 4
        w = moe_weights(0, hidden, 8, 8)
        x_TH = torch.randn(num_tokens, hidden, requires_grad=True)
        ids_TK, scores_TK = qwen3_route(x_TH.detach(), w["gate"], top_k)
        with PeakMemory("cpu") as mem:
            a2a_moe(x_TH, ids_TK, scores_TK, w["w1"], w["w2"], w["w3"]).sum().backward()
        self.assertGreater(mem.peak_bytes, num_tokens * top_k * hidden * 4)

    @needs_build
    def test_the_counting_allocator_is_exact_and_sees_frees_of_older_blocks(self) -> None:
        install_counting_cpu_allocator()  # before `before`: its free is counted
        with PeakMemory("cpu", "allocator") as mem:
            a = torch.empty(1000)
            b = torch.empty(2000)
            del a
            c = torch.empty(500)
        self.assertEqual((mem.peak_bytes, mem.end_bytes), (12000, 10000))
        before = torch.empty(4096)
        with PeakMemory("cpu", "allocator") as mem:
            del before
            after = torch.empty(256)
        self.assertEqual((mem.peak_bytes, mem.end_bytes), (0, 1024 - 16384))
        del b, c, after

    def test_an_unknown_cpu_method_is_rejected(self) -> None:
        with self.assertRaisesRegex(ValueError, "PeakMemory: cpu_method='tracemalloc' is not one of"):
            PeakMemory("cpu", "tracemalloc")  # type: ignore[arg-type]

    def test_an_unknown_device_type_is_rejected(self) -> None:
        with self.assertRaisesRegex(ValueError, "PeakMemory: device meta is neither 'cuda' nor 'cpu'"):
            with PeakMemory("meta"):
                pass


@needs_build
class PeakMemoryGlooTest(DistributedTestCase):
    def test_the_counting_allocator_sees_frees_made_by_gloo_worker_threads(self) -> None:
        # A gloo worker thread sometimes drops the last reference to an all-to-all's buffer: the profiler
        # misses such frees and its level drifts up; the counting allocator's level returns to the gradients.
        install_counting_cpu_allocator()
        group = self.init_pg()
        num_tokens, hidden, top_k, num_local = 128, 16, 4, 4
        experts = range(self.rank * num_local, (self.rank + 1) * num_local)
        w = moe_weights(0, hidden, 8, 8, experts=experts)
        gate = moe_weights(0, hidden, 8, 8)["gate"]
        weights = [w[k].requires_grad_() for k in ("w1", "w2", "w3")]
        x_TH = torch.randn(num_tokens, hidden, requires_grad=True)
        ids_TK, scores_TK = qwen3_route(x_TH.detach(), gate, top_k)
        grad_bytes = sum(t.numel() * t.element_size() for t in [x_TH, *weights])
        with PeakMemory("cpu", "allocator") as mem:
            for _ in range(8):
                a2a_moe(x_TH, ids_TK, scores_TK, *weights, group=group).sum().backward()
            dist.barrier(group)  # gloo's barrier waits for all earlier work of the group...
            time.sleep(0.2)  # ... whose worker threads drop their references right after
        self.assertEqual(mem.end_bytes, grad_bytes)
        self.assertGreater(mem.peak_bytes, num_tokens * top_k * hidden * 4)

if __name__ == "__main__":
    unittest.main()

"""``bench.gpu_idle`` on a hand-written Kineto trace: gaps, their places and the runtime calls."""

from torch.testing._internal.common_utils import TestCase, run_tests

from relay_compile.bench.gpu_idle import by_place, device_span_us, idle_gaps, runtime_calls


def _ev(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


def _trace():
    """Kernels on two streams: 0-100 and 80-150 (one busy interval), 160-170 (a 10 us gap), 400-500 (a 230 us
    gap, after a stream sync that returned at 160, launched from a package frame inside aten::mm)."""
    return [
        _ev("kernel", "gemm_a", 0, 100, tid=7, correlation=1),
        _ev("kernel", "gemm_b", 80, 70, tid=8, correlation=2),
        _ev("gpu_memcpy", "Memcpy DtoD", 160, 10, tid=7, correlation=3),
        _ev("kernel", "scatter", 400, 100, tid=7, correlation=4),
        _ev("cuda_runtime", "cudaLaunchKernel", -20, 5, correlation=1),
        _ev("cuda_runtime", "cudaLaunchKernel", -10, 5, correlation=2),
        _ev("cuda_runtime", "cudaMemcpyAsync", 0, 4, correlation=3),
        _ev("cuda_runtime", "cudaStreamSynchronize", 10, 150),
        _ev("python_function", "relay_compile/runtime/ops.py(160): _run", 5, 500),
        _ev("python_function", "relay_compile/runtime/hop_compute.py(300): forward_hop", 200, 200),
        _ev("python_function", "torch/nn/functional.py(1): silu", 350, 30),
        _ev("cpu_op", "relaymoe::ring_moe", 5, 500),
        _ev("cpu_op", "aten::mm", 380, 20),
        _ev("cuda_driver", "cuLaunchKernel", 390, 8, correlation=4),
    ]


class GpuIdleTest(TestCase):
    def test_gaps_are_merged_device_idle_put_on_the_launch_that_ended_them(self):
        gaps = idle_gaps(_trace(), min_us=20)
        self.assertEqual(len(gaps), 1)  # the 10 us gap is under min_us; the two streams' overlap is one interval
        (gap,) = gaps
        self.assertEqual((gap.start_us, gap.dur_us, gap.next_kernel, gap.launch), (170.0, 230.0, "scatter",
                                                                                   "cuLaunchKernel"))
        self.assertEqual(gap.ops, ("relaymoe::ring_moe", "aten::mm"))
        self.assertEqual(gap.frames, ("runtime/ops.py:_run", "runtime/hop_compute.py:forward_hop"))
        self.assertEqual(gap.after_sync, "cudaStreamSynchronize")
        self.assertEqual(by_place(gaps), [("after cudaStreamSynchronize: runtime/ops.py:_run > "
                                           "runtime/hop_compute.py:forward_hop", 1, 230.0)])
        self.assertEqual(len(idle_gaps(_trace(), min_us=5)), 2)

    def test_only_a_sync_waiting_when_the_device_went_idle_marks_a_gap(self):
        # A sync that starts inside the gap and returns at once did not leave the device idle.
        trace = [e for e in _trace() if "Synchronize" not in e["name"]]
        trace.append(_ev("cuda_runtime", "cudaStreamSynchronize", 300, 1))
        (gap,) = idle_gaps(trace, min_us=20)
        self.assertIsNone(gap.after_sync)
        trace.append(_ev("cuda_runtime", "cudaEventSynchronize", 120, 60))  # waiting at 170, back at 180
        (gap,) = idle_gaps(trace, min_us=20)
        self.assertEqual(gap.after_sync, "cudaEventSynchronize")

    def test_ops_and_frames_come_from_the_launching_thread_and_work_from_one_device(self):
        trace = _trace() + [
            _ev("cpu_op", "aten::other_thread", 380, 20, tid=2),  # encloses the launch's time on another thread
            _ev("python_function", "relay_compile/other.py(1): elsewhere", 350, 100, tid=2),
            _ev("kernel", "on_device_1", 200, 150, tid=7, correlation=9) | {"pid": 2},  # another device's work
        ]
        (gap,) = idle_gaps(trace, min_us=20)
        self.assertEqual((gap.start_us, gap.dur_us), (170.0, 230.0))
        self.assertEqual(gap.ops, ("relaymoe::ring_moe", "aten::mm"))
        self.assertEqual(gap.frames, ("runtime/ops.py:_run", "runtime/hop_compute.py:forward_hop"))

    def test_a_gap_without_a_sync_before_it_or_stacks_is_put_on_its_ops(self):
        trace = [e for e in _trace() if e["cat"] != "python_function" and "Synchronize" not in e["name"]]
        (gap,) = idle_gaps(trace, min_us=20)
        self.assertIsNone(gap.after_sync)
        self.assertEqual(gap.place(), "relaymoe::ring_moe > aten::mm")

    def test_span_busy_time_and_runtime_calls(self):
        self.assertEqual(device_span_us(_trace()), (500.0, 260.0))
        calls = runtime_calls(_trace())
        self.assertEqual(next(iter(calls)), "cudaStreamSynchronize")
        self.assertEqual(calls["cudaLaunchKernel"], (2, 10.0))
        self.assertEqual(device_span_us([]), (0.0, 0.0))


if __name__ == "__main__":
    run_tests()

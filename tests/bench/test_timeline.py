"""Memory over time: a CUDA memory-history snapshot (``relay_compile.memory.history_events``) becomes the
bench's level series without the backward marker (``relay_compile.bench.timeline``); snapshots shrink without frames.
"""

from __future__ import annotations

import unittest

from relay_compile.bench.timeline import BACKWARD_MARKER_BYTES, levels_without_marker, strip_frames
from relay_compile.memory import history_events


class CudaSnapshotParsingTest(unittest.TestCase):
    def test_trace_events_become_a_level_series_without_the_backward_marker(self) -> None:
        # The shape of torch.cuda.memory._snapshot()["device_traces"][device] entries (CUDA only, so synthetic).
        marker = BACKWARD_MARKER_BYTES
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
        events = history_events(snapshot, 0)
        times, levels, backward_at = levels_without_marker(events)
        self.assertEqual(levels, [512, 1536, 1024])
        self.assertEqual(times, [0.0, 1.0, 3.0])
        self.assertEqual(backward_at, 2.0)
        stripped = strip_frames(snapshot)
        self.assertNotIn("frames", stripped["device_traces"][0][1])
        self.assertNotIn("frames", stripped["segments"][0]["blocks"][0])
        self.assertIn("frames", snapshot["device_traces"][0][1])


if __name__ == "__main__":
    unittest.main()

"""Per-rank peak memory of ranks run as threads (``bench.rank_threads``): each rank measures its own.

- CUDA: the caching allocator's memory history, a rank's events being those on its own stream (it allocates
  nowhere else; the group's link streams only copy): the peak of their running sum between marker allocations,
  allocated bytes as the allocator rounds them. (A ``torch.cuda.MemPool`` per rank measured reserved bytes, which
  fragmentation inflated to 4.5x a ring's allocated peak, and torch 2.11 asserts when a pool is destroyed while
  another thread allocates to its own.)
- CPU: the counting CPU allocator (``memory.install_counting_cpu_allocator``) counts the blocks each rank's
  thread allocates, wherever freed.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any

import torch

from relay_compile.bench.rank_group import RankThreadsError
from relay_compile.memory import install_counting_cpu_allocator

__all__ = ["RankPeak"]


class RankPeak:
    """Context manager on a rank thread: ``peak_bytes``, this rank's peak allocated above entry (module docstring).

    CUDA: the caching allocator's memory history (recorded while any measurement is open), this rank's events:
    those on its stream (a rank allocates on its own stream; link streams only copy) between two pairs of
    marker allocations of sizes unique to the measurement; their running sum's maximum. CPU: the counting CPU
    allocator's bytes of blocks this thread allocated (``memory.install_counting_cpu_allocator``: built once,
    needs a C++ compiler; install it before the tensors the measurement frees are made).
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.peak_bytes = 0
        self._base = 0
        self._markers: tuple[int, ...] = ()

    def __enter__(self) -> RankPeak:
        if self.device.type == "cuda":
            _history(+1)
            n = next(_MARKS) % 500
            self._markers = tuple(512 * (1 + 4 * n + i) for i in range(4))
            _mark(self._markers[:2], self.device)
        else:
            counter = install_counting_cpu_allocator()
            tag = _thread_tag()
            counter.set_thread_tag(tag)
            counter.reset_tag_peak(tag)
            self._base = counter.tag_stats(tag)[0]
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type != "cuda":
            self.peak_bytes = install_counting_cpu_allocator().tag_stats(_thread_tag())[1] - self._base
            return
        stream = torch.cuda.current_stream(self.device)
        _mark(self._markers[2:], self.device)
        stream.synchronize()
        try:
            trace = torch.cuda.memory._snapshot()["device_traces"][self.device.index]
            self.peak_bytes = _stream_peak(trace, stream.cuda_stream, self._markers)
        finally:
            _history(-1)


_MARKS = itertools.count()
_HISTORY_LOCK = threading.Lock()
_history_users = 0


def _history(delta: int) -> None:
    """Count an open CUDA measurement in (+1) or out (-1): the memory history records while any is open."""
    global _history_users
    with _HISTORY_LOCK:
        if _history_users == 0 and delta > 0:
            torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                     max_entries=1 << 22)
        _history_users += delta
        if _history_users == 0:
            torch.cuda.memory._record_memory_history(enabled=None)


def _mark(sizes: Sequence[int], device: torch.device) -> None:
    """Allocate and free blocks of ``sizes`` bytes, in order, on the current stream: a marker in the history."""
    blocks = [torch.empty(size, dtype=torch.uint8, device=device) for size in sizes]
    del blocks


def _stream_peak(trace: list[dict[str, Any]], stream: int, markers: Sequence[int]) -> int:
    """The peak of the running sum of ``stream``'s allocations minus completed frees between the marker pairs
    (``markers[:2]`` opens, ``markers[2:]`` closes: two allocations in a row on the stream), above the level at
    the opening marker. Completed frees may fall between a pair's allocations: the allocator completes frees
    deferred by other streams' use (``record_stream``) inside the next allocation."""
    events = [e for e in trace if e.get("stream") == stream and e.get("action") in ("alloc", "free_completed")]
    allocs = [(i, e["size"]) for i, e in enumerate(events) if e["action"] == "alloc"]

    def find(a: int, b: int) -> tuple[int, int]:
        hits = [(i, j) for (i, size), (j, nxt) in zip(allocs, allocs[1:]) if (size, nxt) == (a, b)]
        if not hits:
            raise RankThreadsError("RankPeak: the memory history lost this measurement's markers (too many "
                                   "events: measure a shorter span)")
        return hits[-1]

    (start, second), (end, _) = find(*markers[:2]), find(*markers[2:])
    level, peak, ignored = 0, 0, {events[start]["addr"], events[second]["addr"]}
    for i in range(start + 1, end):
        e = events[i]
        if i == second:
            continue
        if e["action"] == "free_completed" and e["addr"] in ignored:
            ignored.discard(e["addr"])
            continue
        level += e["size"] if e["action"] == "alloc" else -e["size"]
        peak = max(peak, level)
    return peak


_TAGS = itertools.count(1)
_LOCAL = threading.local()


def _thread_tag() -> int:
    """This thread's tag in the counting CPU allocator (one per thread, from 1)."""
    if not hasattr(_LOCAL, "tag"):
        _LOCAL.tag = next(_TAGS)
    return _LOCAL.tag

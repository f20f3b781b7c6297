"""Peak memory of a region on this rank, above the level at entry, and memory over time for figures.

    with PeakMemory(x.device) as mem:
        model(x).sum().backward()
    print(mem.peak_bytes, mem.end_bytes)

- CUDA: ``torch.cuda.reset_peak_memory_stats`` at entry, ``max_memory_allocated`` at exit (after a
  synchronize), minus ``memory_allocated`` at entry. Exact for the caching allocator's allocated bytes.
- CPU, ``cpu_method="profiler"`` (default, nothing to build): ``torch.profiler`` with ``profile_memory=True``
  records every allocation and free of the CPU allocator made on the profiled thread; ``[memory]`` events
  carry signed ``nbytes()`` (positive allocates, negative frees). Their running sum from entry, in time order,
  is the level above entry; its maximum is the peak. Missed: frees of blocks allocated before the profiler
  started (it warns "Memory block of unknown size"), and whatever other threads do. A gloo worker thread
  sometimes drops the last reference to an all-to-all's buffer, freeing it unseen: the level then drifts up
  (an upper bound). Allocations on other threads would be an under-estimate; with the reference layer over
  gloo, the profiler's peaks matched the counting allocator's whenever no free was missed.
- CPU, ``cpu_method="allocator"``: a counting CPU allocator (``c10::SetCPUAllocator``, built once with
  ``load_inline``, about a minute; cached after) counts every thread's allocations exactly, like the CUDA
  allocator's statistics. Installed process-wide on first use; blocks allocated before that are freed unseen,
  so call ``install_counting_cpu_allocator()`` before building the model. It also counts per thread tag (the
  blocks a tagged thread allocated, wherever freed): ranks run as threads measure themselves so
  (``bench.rank_threads.RankPeak``).

Memory over time (``memory_events``, ``memory_timeline``), for figures: every allocation and free of one run,
in time order, from one of two sources:

- ``"profiler"`` (both devices): the profiler's ``[memory]`` events, as for ``PeakMemory`` (CPU: this
  thread's, with the caveats above). Times count from the profiler's trace start.
- ``"history"`` (CUDA only): the caching allocator's memory history (``torch.cuda.memory._record_memory_history``,
  Python stacks), whose snapshot also opens at pytorch.org/memory_viz: the device's ``alloc`` and
  ``free_completed`` events; times count from the first of them.

One profiler at a time: a CPU profiler measurement cannot nest inside another, nor run under
``torch.profiler``. CUDA and allocator measurements reset the peak: an outer one's peak is lost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, TypeVar

import torch
from torch.profiler import ProfilerActivity, profile

log = logging.getLogger(__name__)

__all__ = [
    "PeakMemory", "measure_peak", "MemoryEvents", "memory_events", "memory_timeline", "history_events",
    "install_counting_cpu_allocator", "CpuMethod", "CudaSource",
]

R = TypeVar("R")
DeviceLike = torch.device | str | int | None
# How CPU memory is measured: "profiler" (this thread's allocator events; an upper bound when other threads
# free) or "allocator" (the counting CPU allocator; exact, needs a C++ compiler once).
CpuMethod = Literal["profiler", "allocator"]
CPU_METHODS: tuple[str, ...] = ("profiler", "allocator")
# Where memory over time on CUDA comes from: "profiler" (the profiler's memory events) or "history" (the caching
# allocator's memory history, with a snapshot for pytorch.org/memory_viz). The CPU always uses the profiler.
CudaSource = Literal["profiler", "history"]
CUDA_SOURCES: tuple[str, ...] = ("profiler", "history")

# ----------------------------------------------------------------------------------------------------------
# Counting CPU allocator
# ----------------------------------------------------------------------------------------------------------

# Wraps the CPU allocator: keeps each block's size, the current total and its peak. Blocks stay "simple"
# (context == data), so copy-on-write and raw deleters behave as before.
_COUNTING_ALLOCATOR_CPP = r"""
#include <torch/extension.h>
#include <c10/core/CPUAllocator.h>
#include <mutex>
#include <unordered_map>

namespace {
struct Level { int64_t current = 0, peak = 0; };
struct Block { size_t size; int tag; };
std::mutex mu;
std::unordered_map<void*, Block> sizes;
int64_t current = 0, peak = 0;
// Per thread tag (0: none): the bytes of blocks its threads allocated, wherever they are freed.
std::unordered_map<int, Level> tags;
thread_local int thread_tag = 0;
c10::DeleterFnPtr base_deleter = nullptr;

void counting_delete(void* ptr) {
  {
    std::lock_guard<std::mutex> g(mu);
    auto it = sizes.find(ptr);
    if (it != sizes.end()) {
      current -= it->second.size;
      if (it->second.tag) tags[it->second.tag].current -= it->second.size;
      sizes.erase(it);
    }
  }
  base_deleter(ptr);
}

struct CountingAllocator final : c10::Allocator {
  c10::Allocator* base;
  explicit CountingAllocator(c10::Allocator* b) : base(b) {}
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr d = base->allocate(n);
    void* ptr = d.get();
    if (ptr == nullptr) return d;
    TORCH_CHECK(d.get_context() == ptr && d.get_deleter() == base_deleter,
                "counting allocator: the CPU allocator returned a block with its own context");
    d.release_context();
    {
      std::lock_guard<std::mutex> g(mu);
      sizes[ptr] = Block{n, thread_tag};
      current += n;
      if (current > peak) peak = current;
      if (thread_tag) {
        Level& level = tags[thread_tag];
        level.current += n;
        if (level.current > level.peak) level.peak = level.current;
      }
    }
    return c10::DataPtr(ptr, ptr, &counting_delete, d.device());
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counting_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    base->copy_data(dest, src, count);
  }
};
CountingAllocator* instance = nullptr;
}  // namespace

bool install() {
  if (instance) return false;
  c10::Allocator* base = c10::GetCPUAllocator();
  base_deleter = base->raw_deleter();
  TORCH_CHECK(base_deleter != nullptr, "counting allocator: the CPU allocator has no raw deleter");
  instance = new CountingAllocator(base);  // never freed: its blocks may outlive any Python object
  c10::SetCPUAllocator(instance, /*priority=*/100);
  return true;
}
std::vector<int64_t> stats() { std::lock_guard<std::mutex> g(mu); return {current, peak}; }
void reset_peak() { std::lock_guard<std::mutex> g(mu); peak = current; }
void set_thread_tag(int64_t tag) { thread_tag = static_cast<int>(tag); }
std::vector<int64_t> tag_stats(int64_t tag) {
  std::lock_guard<std::mutex> g(mu);
  Level& level = tags[static_cast<int>(tag)];
  return {level.current, level.peak};
}
void reset_tag_peak(int64_t tag) {
  std::lock_guard<std::mutex> g(mu);
  Level& level = tags[static_cast<int>(tag)];
  level.peak = level.current;
}
"""

_counting_allocator: Any = None


def install_counting_cpu_allocator() -> Any:
    """Build (once, cached by torch's extension cache) and install the counting CPU allocator; idempotent.

    Returns the extension module: ``stats() -> [current_bytes, peak_bytes]``, ``reset_peak()``; per thread tag
    (``set_thread_tag(tag)`` on a thread, ``tag > 0``; blocks count against the tag of the thread that allocated
    them, wherever they are freed): ``tag_stats(tag) -> [current_bytes, peak_bytes]``, ``reset_tag_peak(tag)``.
    """
    global _counting_allocator
    if _counting_allocator is None:
        from torch.utils.cpp_extension import load_inline

        module = load_inline(
            "relay_compile_counting_cpu_allocator",
            cpp_sources=_COUNTING_ALLOCATOR_CPP,
            functions=["install", "stats", "reset_peak", "set_thread_tag", "tag_stats", "reset_tag_peak"],
        )
        if module.install():
            log.info("memory: counting CPU allocator installed")
        _counting_allocator = module
    return _counting_allocator


def _resolve_device(device: DeviceLike) -> torch.device:
    """``device``, or the current CUDA device when CUDA is available, else the CPU."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _profiler(device: torch.device) -> profile:
    """A memory-recording profiler for ``device``'s allocations (CUDA ones need the CUDA activity)."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    return profile(activities=activities, profile_memory=True)


@dataclass(kw_only=True)
class MemoryEvents:
    """Allocations and frees on one device over one run, in time order (the source's own order for ties).

    ``times_ns[i]`` is event i's time in nanoseconds since the source's origin (profiler: its trace start;
    memory history: its first event); ``nbytes[i]`` its signed size (> 0 allocates, < 0 frees). ``snapshot``
    is the CUDA memory history's ``torch.cuda.memory._snapshot()`` (source ``"history"``), else None.
    """

    times_ns: list[int]
    nbytes: list[int]
    snapshot: dict[str, Any] | None = None

    def levels(self) -> list[int]:
        """Bytes above the level at the start after each event."""
        return _running_levels(self.nbytes)


def _profiler_events(prof: profile, device: torch.device) -> MemoryEvents:
    """``device``'s allocator events of a finished memory-recording profiler, times since its trace start."""
    device_type = torch._C._autograd.DeviceType.CUDA if device.type == "cuda" else torch._C._autograd.DeviceType.CPU
    deltas = []
    for event in prof.profiler.kineto_results.events():
        if event.name() != "[memory]" or event.device_type() != device_type:
            continue
        if device.type == "cuda" and event.device_index() != device.index:
            continue
        deltas.append((event.start_ns(), event.nbytes()))
    deltas.sort(key=lambda d: d[0])
    start_ns = prof.profiler.kineto_results.trace_start_ns()
    return MemoryEvents(times_ns=[t - start_ns for t, _ in deltas], nbytes=[n for _, n in deltas])


def history_events(snapshot: dict[str, Any], device_index: int) -> MemoryEvents:
    """The ``alloc`` and ``free_completed`` events of a CUDA memory-history snapshot's device ``device_index``.

    Times count from the first of them (``time_us``; an event without one takes its index in the trace as
    microseconds). Other actions (segment maps, free requests, OOMs) change no allocated bytes.
    """
    traces = snapshot.get("device_traces") or []
    trace = traces[device_index] if device_index < len(traces) else []
    times_ns: list[int] = []
    nbytes: list[int] = []
    t_first = None
    for i, e in enumerate(trace):
        action = e.get("action")
        if action not in ("alloc", "free_completed"):
            continue
        t = e.get("time_us", i)
        t_first = t if t_first is None else t_first
        times_ns.append((t - t_first) * 1000)
        nbytes.append(e["size"] if action == "alloc" else -e["size"])
    return MemoryEvents(times_ns=times_ns, nbytes=nbytes, snapshot=snapshot)


def _running_levels(nbytes: list[int]) -> list[int]:
    """Bytes above entry after each event."""
    levels, level = [], 0
    for n in nbytes:
        level += n
        levels.append(level)
    return levels


class PeakMemory:
    """Context manager: ``peak_bytes`` and ``end_bytes`` allocated on ``device`` above the level at entry.

    Args:
        device: a CUDA device (allocator statistics) or the CPU; None picks the current CUDA device when CUDA
            is available, else the CPU.
        cpu_method: how the CPU is measured (see ``CpuMethod``).
    """

    def __init__(self, device: DeviceLike = None, cpu_method: CpuMethod = "profiler") -> None:
        if cpu_method not in CPU_METHODS:
            raise ValueError(f"PeakMemory: cpu_method={cpu_method!r} is not one of {CPU_METHODS}")
        self.device = _resolve_device(device)
        self.cpu_method = cpu_method
        self.peak_bytes = 0
        self.end_bytes = 0
        self._base_bytes = 0
        self._prof: profile | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base_bytes = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.device.type == "cpu" and self.cpu_method == "allocator":
            counter = install_counting_cpu_allocator()
            counter.reset_peak()
            self._base_bytes = counter.stats()[0]
        elif self.device.type == "cpu":
            self._prof = _profiler(self.device)
            self._prof.__enter__()
        else:
            raise ValueError(f"PeakMemory: device {self.device} is neither 'cuda' nor 'cpu'; pass one of those")
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base_bytes
            self.end_bytes = torch.cuda.memory_allocated(self.device) - self._base_bytes
            return
        if self.cpu_method == "allocator":
            current, peak = install_counting_cpu_allocator().stats()
            self.peak_bytes, self.end_bytes = peak - self._base_bytes, current - self._base_bytes
            return
        assert self._prof is not None, "PeakMemory: __exit__ without __enter__"
        self._prof.__exit__(exc_type, exc, tb)
        levels = _profiler_events(self._prof, self.device).levels()
        self.peak_bytes = max([0, *levels])
        self.end_bytes = levels[-1] if levels else 0
        self._prof = None
        log.debug("PeakMemory(%s): peak %d B, end %d B above entry", self.device, self.peak_bytes, self.end_bytes)


def measure_peak(
    fn: Callable[..., R], *args: Any, device: DeviceLike = None, cpu_method: CpuMethod = "profiler", **kwargs: Any
) -> tuple[R, int]:
    """Run ``fn(*args, **kwargs)``; return its result and the peak bytes above entry on ``device``."""
    with PeakMemory(device, cpu_method) as mem:
        result = fn(*args, **kwargs)
    return result, mem.peak_bytes


def memory_events(
    fn: Callable[..., Any], *args: Any, device: DeviceLike = None, cuda_source: CudaSource = "profiler", **kwargs: Any
) -> MemoryEvents:
    """Every allocation and free on ``device`` during one run of ``fn(*args, **kwargs)`` (module docstring).

    Args:
        device: a CUDA device or the CPU; None picks the current CUDA device when CUDA is available, else the CPU.
        cuda_source: ``"profiler"`` or ``"history"`` (CUDA memory history with its snapshot in the result;
            recording stops after the run); the CPU uses the profiler either way.
    """
    if cuda_source not in CUDA_SOURCES:
        raise ValueError(f"memory_events: cuda_source={cuda_source!r} is not one of {CUDA_SOURCES}")
    device = _resolve_device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if device.type == "cuda" and cuda_source == "history":
        # Python stacks only: C++ frames take long to symbolize and make the snapshot large.
        torch.cuda.memory._record_memory_history(context="all", stacks="python", max_entries=1_000_000)
        try:
            fn(*args, **kwargs)
            torch.cuda.synchronize(device)
            snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        return history_events(snapshot, device.index)
    with _profiler(device) as prof:
        fn(*args, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return _profiler_events(prof, device)


def memory_timeline(
    fn: Callable[..., Any], *args: Any, device: DeviceLike = None, cuda_source: CudaSource = "profiler", **kwargs: Any
) -> tuple[list[float], list[int]]:
    """Memory on ``device`` over one run of ``fn(*args, **kwargs)``, for plots (paper Figures 4 and 7).

    ``memory_events`` as a step function (CPU: this thread's events, with the caveats of ``cpu_method="profiler"``).

    Returns:
        times_s: seconds since the source's origin (module docstring), one point at 0.0, then one per
            allocation or free.
        bytes: allocated bytes above the level at entry after each point (a step function).
    """
    events = memory_events(fn, *args, device=device, cuda_source=cuda_source, **kwargs)
    return [0.0] + [t / 1e9 for t in events.times_ns], [0] + events.levels()

"""Simulated expert parallelism on one device with every rank real: N ranks as threads of this process.

    def step(rank: int, group: dist.ProcessGroup) -> Tensor:          # runs on every rank, concurrently
        x, ids, scores, w1, w2, w3 = this_ranks_inputs(rank)
        with RankPeak() as peak:
            ring_moe(x, ids, scores, w1, w2, w3, group=group).sum().backward()
        return peak.peak_bytes

    peaks = run_rank_threads(8, step, device="cuda")                   # [rank 0's result, rank 1's, ...]

The stand-in group (``bench.standin_group``) makes every peer a copy of rank 0: exact for expert routing, but
token routing then computes ``N * Y_0`` and routing is symmetric. Here each rank is a thread running the
caller's code on its own tokens, routing and experts, with its own process group and CUDA stream,
and the group moves real data between ranks, so ``ring_moe``, ``a2a_moe`` and the backend run unmodified and
compute what N processes would.

How it is built:

- **torch.distributed per thread.** For the run, the process's c10d state is made thread-local: torch's
  ``ThreadLocalWorld`` (from its threaded test process group) and c10d's thread isolation of the group
  registry in which functional collectives and ``ring_moe`` resolve group names. Every thread calls
  ``init_process_group``/``new_group`` as a process would and gets its own rank's groups under the same names.
- **The group** (``bench.rank_group.RankThreadGroup``, a Python ``ProcessGroup`` registered as a backend, as the
  stand-in is): point to point joined by whichever side posts second, copied on the receiver's link stream;
  collectives done by the last rank to join. A rank that raises fails every waiting rank at once; a wait past
  ``timeout`` raises ``RankThreadsError`` naming rank, peer and operation.
- **Autograd on the rank's own thread** (``torch.autograd.set_multithreading_enabled(False)``): the engine's
  one worker thread per device would run the ranks' backward passes one after another, and a ring's backward
  waits for its neighbour's: they would never finish.
- **Memory per rank** (``bench.rank_peak.RankPeak``): CUDA, the rank's stream's events in the caching
  allocator's memory history; CPU, the counting CPU allocator's per-thread tags.

Not modeled: the ranks' host work shares one interpreter (the GIL) and their kernels share one GPU, so a step's
time is the group's, not one rank's on its own GPU; link time is a device copy. ``chunk_graphs`` (CUDA graph
arenas shared by the process) is refused on rank threads. One run at a time per process.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from relay_compile.bench.rank_group import BACKEND, RankRun, RankThreadGroup, RankThreadsError, activated
from relay_compile.bench.rank_peak import RankPeak
from relay_compile.runtime import specs

__all__ = ["BACKEND", "RankPeak", "RankThreadGroup", "RankThreadsError", "run_rank_threads"]

R = TypeVar("R")
_RUN_LOCK = threading.Lock()


# ----------------------------------------------------------------------------------------------------------
# Running the ranks
# ----------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _thread_local_c10d() -> Iterator[None]:
    """c10d's world and group registry per thread while within (module docstring)."""
    from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

    class World(ThreadLocalWorld):
        """torch's ThreadLocalWorld, with what its version may lack (2.11's has no ``comms``, which
        ``destroy_process_group`` reads)."""

        @property
        def comms(self) -> list[Any]:
            return self._get_world().__dict__.setdefault("comms", [])

    c10d = dist.distributed_c10d
    saved = c10d._world
    c10d._world = World()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    try:
        yield
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        c10d._world = saved


def _rank_main(run: RankRun, rank: int, fn: Callable[[int, dist.ProcessGroup], Any], device: torch.device) -> None:
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.autograd.set_multithreading_enabled(False))
            specs.per_thread_states()
            if device.type == "cuda":
                torch.cuda.set_device(device)
                stack.enter_context(torch.cuda.stream(torch.cuda.Stream(device)))
            dist.init_process_group(BACKEND, rank=rank, world_size=run.size, store=run.store,
                                    timeout=timedelta(seconds=run.timeout))
            try:
                run.results[rank] = fn(rank, dist.group.WORLD)
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()
            finally:
                dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported by run_rank_threads, every rank's
        run.fail(rank, e)


def run_rank_threads(size: int, fn: Callable[[int, dist.ProcessGroup], R], *, device: torch.device | str = "cpu",
                     timeout: float = 60.0) -> list[R]:
    """Run ``fn(rank, group)`` on ``size`` ranks, each a thread of this process (module docstring); returns the
    ranks' results in rank order. ``group`` is the rank's world group (``dist.group.WORLD`` on its thread).

    Raises:
        ValueError: ``size`` below 1.
        RankThreadsError: another run is in progress. Where ranks fail, the lowest failing rank's exception,
            with every failure listed in its notes (ranks that only waited for it raise ``RankThreadsError``).
    """
    if size < 1:
        raise ValueError(f"run_rank_threads: size must be at least 1, got {size}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if not _RUN_LOCK.acquire(blocking=False):
        raise RankThreadsError("run_rank_threads: another run is in progress in this process")
    run = RankRun(size, timeout)
    try:
        threads = [threading.Thread(target=_rank_main, args=(run, r, fn, device), name=f"relaymoe-rank{r}")
                   for r in range(size)]
        with activated(run), _thread_local_c10d():
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        _RUN_LOCK.release()
    if run.failures:
        # A rank's own error, not one that only waited for another's.
        first = min((r for r, e in run.failures.items() if not isinstance(e, RankThreadsError)),
                    default=min(run.failures))
        error = run.failures[first]
        for r, e in sorted(run.failures.items()):
            if r != first:
                error.add_note(f"rank {r}: {type(e).__name__}: {e}")
        raise error
    return run.results

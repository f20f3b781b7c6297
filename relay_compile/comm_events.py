"""Which communication one step runs, as the profiler sees it: all-to-all events against P2P events.

    events = count_comm_events(lambda: model(x).sum().backward())
    assert events.all_to_all == 0 and events.p2p > 0      # the token all-to-alls became ring transfers

Counts the CPU profiler's events by name (one forward + backward under ``torch.profiler``, CPU activity):
names containing "all_to_all"/"alltoall" are all-to-alls (gloo's ``gloo:all_to_all``, the c10d op's
``c10d::alltoall_base_``), "send"/"recv"/"batch_isend_irecv" are P2P (``gloo:send``/``gloo:recv`` of the ring's
``batch_isend_irecv``), and ``relaymoe::`` ops are the ring's own calls. Beside the stack, like
``relay_compile.memory``: examples and tests use it, nothing in the package does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch.profiler import ProfilerActivity, profile

__all__ = ["A2A_KEYS", "P2P_KEYS", "CommEvents", "count_comm_events"]

A2A_KEYS = ("all_to_all", "alltoall")
P2P_KEYS = ("send", "recv", "batch_isend_irecv")


class CommEvents(NamedTuple):
    """Profiler events of one step: all-to-alls, P2P transfers, and every communication event's name."""

    all_to_all: int
    p2p: int
    names: list[str]  # sorted distinct names of the events counted, and of other gloo/c10d events
    ring_calls: dict[str, int]  # relaymoe op name -> calls (ring_moe: forward rings, ring_moe_backward)


def count_comm_events(step: Callable[[], object]) -> CommEvents:
    """The communication events of ``step()`` (say, one forward + backward) on this thread's profiler."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    names = [e.name for e in prof.events()]
    a2a = sum(any(k in n.lower() for k in A2A_KEYS) for n in names)
    p2p = sum(any(k in n.lower() for k in P2P_KEYS) for n in names)
    comm = sorted({n for n in names if any(k in n.lower() for k in (*A2A_KEYS, *P2P_KEYS, "gloo", "c10d"))})
    rings = {n: names.count(n) for n in sorted(set(names)) if n.startswith("relaymoe::")}
    return CommEvents(a2a, p2p, comm, rings)

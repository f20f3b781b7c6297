"""Simulated expert parallelism on one device: rank 0 of an N-rank group whose peers are stand-ins.

    group = standin_group(8)                     # this process is rank 0 of 8
    y = ring_moe(x, ids, scores, w1, w2, w3, group=group)
    y_ref = a2a_moe(x, ids, scores, w1, w2, w3, group=group)

**The model: every peer is a copy of this rank.** Peers hold the same tokens, the same routing and the same
expert weights as rank r, so every message a peer would send is one this rank can produce itself:

- send/recv (ring shifts, ``batch_isend_irecv``): a receive from ``src`` takes what this rank sent to
  ``(2r - src) mod N`` with the same tag. For a ring shift (send to r+1, receive from r-1) that is the tensor
  just sent: the data is copied into the receive buffer, which the caller allocated as it would for a peer.
- all-to-all: output chunk ``s`` is this rank's input chunk ``(2r - s) mod N`` (the same rule); the splits
  must agree with it, which they do when the split sizes came from an all-to-all of counts on this group.
- all-gather: this rank's input, N times. all-reduce: SUM multiplies by N; MAX, MIN, AVG, BAND, BOR keep
  the value. reduce-scatter: this rank's chunk of its input (times N for SUM). broadcast, barrier: no-ops.

What follows for MoE (tested in tests/bench/test_standin_group.py), with E = N * E_l experts whose weights repeat
this rank's partition (``W[e] = W_local[e mod E_l]``, the stand-in returns this rank's weights as every
partition's):

- ``a2a_moe`` and ``ring_moe(routing="expert")`` compute exactly ``dense_moe`` over the E experts, forward and
  backward, with the weight gradient summed over the N copies of each partition (tied weights).
- ``ring_moe(routing="token")`` computes ``N * Y_0``, where ``Y_0`` takes only the pairs on this rank's experts
  (``ids < E_l``): each hop revisits this rank's own tokens with its own experts. The work per hop (about
  ``T*K/N`` pairs under balanced routing) and the buffers are those of a real ring; the numbers are not.

Memory and compute on this rank are exact; link time is not simulated (copies run at device memory bandwidth),
there are no NCCL buffers, and routing is perfectly symmetric. Report link time separately from a stated model
(``relay_compile.bench.link_model``). By default every copy runs on the compute stream, so a ring's transfers
add to its step though a real one overlaps them. ``standin_group(n, link_stream=True)`` runs the point-to-point
copies on a stream of their own (CUDA), as NCCL runs sends and receives: a copy is queued when the send and the
receive it mirrors have both been posted, after the work queued by then, and waiting on either side's ``Work``
makes the waiting stream wait for it (``_LinkWork``). The collectives run on the caller's current stream, as
before: their callers wait for them at once, so a stream of their own would change nothing there.
This rank's memory traffic is the same (a real send reads, a real receive writes this rank's memory); what is
not modeled is the link's bandwidth (the copy is faster than NVLink). Measured on an H100 (EP 8 and 64, Qwen3
layer): a forced ring's step is within 1% on either stand-in (docs/bench/link-stream/raw-1-h100), and the link
stream's copies ran beside a kernel for 0.02-0.26 of their 3.04-3.13 ms per step at EP=8, 65536 tokens (three
profiles, docs/bench/h100-recheck): a ``Tensor.copy_`` within one GPU runs over a grid as large as the message,
and it barely runs beside the hops' persistent GEMMs (13% of a 453 MiB copy overlapped a GEMM with no dependency
between them). ``link_ctas=n`` copies by ``n`` thread blocks instead (``kernels.bounded_copy``), as NCCL's
channels take a few SMs and leave the rest to compute; ``link_high_priority`` puts that stream at the device's
highest priority, as ``is_high_priority_stream`` does NCCL's. On an H100 (EP=8, 65536 tokens) 16 blocks copy at
~330 GB/s, about NVLink's rate; at high priority the step moved less than its spread between runs
(docs/BENCHMARKS.md, "The scatter-add's row order, and the stand-in's link by a few blocks").

How it is built (docs/ARCHITECTURE.md, section 5 "Measured facts"; shown on torch 2.13 CPU and torch 2.11
CUDA): a Python subclass of ``torch.distributed.ProcessGroup`` (a ``Backend`` subclass cannot be constructed
from Python), registered with ``dist.Backend.register_backend`` and started with
``init_process_group(BACKEND, rank=0, ..., store=HashStore())``. It keeps its group name in Python, implements
the collectives under their torch 2.13 names and the older ones, and returns completed works, so functional
collectives (which find the group by name from C++) reach it too. A ``FakeProcessGroup`` is attached as its
C++ backend for the few paths with no Python override.

Every size gets its own subgroup of one stand-in world (``dist.new_group``), cached for the process: group
names stay unique, so per-group caches elsewhere (ring specs) never see a stale group under a reused name.
"""

from __future__ import annotations

import logging
from collections import defaultdict, deque
from datetime import timedelta
from typing import Any

import torch
import torch._dynamo.decorators
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from relay_compile.bench.python_group import PythonProcessGroup, completed_work
from relay_compile.kernels.bounded_copy import bounded_copy_

log = logging.getLogger(__name__)

__all__ = [
    "BACKEND", "StandinGroup", "StandinError", "standin_group", "standin_world", "drop_pending_messages",
    "destroy_standin_groups",
]

# The name the stand-in backend is registered under (torch upper-cases it in its plugin table).
BACKEND = "relaymoe_standin"

# Size of the stand-in world: a namespace for subgroups only, never used for collectives itself.
_WORLD_SIZE = 1 << 12

_GROUPS: dict[tuple[int, bool, int, bool], dist.ProcessGroup] = {}
# CUDA stream priority of a ``link_high_priority`` link: lower is higher; torch clamps it to the device's range.
HIGH_PRIORITY = -1
# Group names handed out so far in this process: a restarted world continues the count (see _ensure_world).
_names_used = 0


class StandinError(RuntimeError):
    """A collective the stand-in model cannot answer (for example all-to-all splits that are not symmetric)."""


class _DoneWork(dist.Work):
    """A completed point-to-point operation. One shared instance (``_DONE``): a ring posts a few hundred sends
    and receives per step at EP=64, and a ``Future`` per message (``completed_work``) cost the simulation tens of
    microseconds of host time each, charged to the ring's time though a real peer has no such cost."""

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        return True

    def get_future(self) -> Future:
        fut: Future = Future()
        fut.set_result(None)
        return fut


_DONE = _DoneWork()

# Dynamo never compiles the frames of ``send``/``recv`` (its code objects are skipped) at no cost per call: the
# ring posts two transfers per hop, and ``torch.compiler.disable``'s wrapper (eval-frame switches each call)
# was a few percent of an EP=64 step's host time, a cost no real backend's send has. Their callees stay
# traceable, which matters only to a compiled region that graph-breaks on a send (it then runs eagerly anyway).
# Older torch without ``skip``: the wrapper.
_skip_frame = getattr(torch._dynamo.decorators, "skip", torch.compiler.disable)


class _LinkWork(dist.Work):
    """A point-to-point copy queued on the link stream (``StandinGroup(link_stream=True)``, CUDA): waiting makes
    the current stream wait for it, as waiting on an NCCL send or receive does."""

    def __init__(self, done: torch.cuda.Event, device: torch.device) -> None:
        super().__init__()
        self.done, self.device = done, device

    def is_completed(self) -> bool:
        return self.done.query()

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        torch.cuda.current_stream(self.device).wait_event(self.done)
        return True

    def get_future(self) -> Future:
        """Completed at once (nothing in the package waits on the future of a send or receive): unlike NCCL's,
        which completes with the copy."""
        fut: Future = Future()
        fut.set_result(None)
        return fut


class _LinkStream:
    """The stream a group's point-to-point copies run on (one per CUDA device; module docstring); ``ctas`` > 0:
    each copy by that many thread blocks (``kernels.bounded_copy``), else ``Tensor.copy_``; ``high_priority``: a
    stream of the device's highest priority, whose blocks the scheduler places before those of waiting kernels of
    lower priority (as ``ProcessGroupNCCL.Options.is_high_priority_stream`` makes NCCL's)."""

    def __init__(self, device: torch.device, ctas: int = 0, high_priority: bool = False) -> None:
        self.device, self.ctas = device, ctas
        self.stream = torch.cuda.Stream(device, priority=HIGH_PRIORITY if high_priority else 0)

    def copy(self, outs: list[Tensor], ins: list[Tensor]) -> dist.Work:
        """``outs`` take ``ins`` after the work queued so far (what was sent is ready); both sides' tensors are
        kept from reuse until the copy ran (``record_stream``, as NCCL keeps them); the work waits for it."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for out, t in zip(outs, ins, strict=True):
                bounded_copy_(out, t, self.ctas)
        for t in (*outs, *ins):
            t.record_stream(self.stream)
        done = torch.cuda.Event()
        done.record(self.stream)
        return _LinkWork(done, self.device)


def _wait_copy(copied: dist.Work | None) -> None:
    """Wait for the copy that matched a pending send or receive (none: it ran on the compute stream)."""
    if copied is not None:
        copied.wait()


class _PendingRecvWork(dist.Work):
    """A receive posted before its matching send: completes when the send arrives; waiting earlier is a bug."""

    def __init__(self, tensors: list[Tensor], src: int, tag: int) -> None:
        super().__init__()
        self.tensors, self.src, self.tag = tensors, src, tag
        self.done = False
        self.copied: dist.Work | None = None  # the link stream's copy, once the send arrived

    def is_completed(self) -> bool:
        return self.done and (self.copied is None or self.copied.is_completed())

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if not self.done:
            raise StandinError(
                f"stand-in group: a receive from rank {self.src} (tag {self.tag}) was waited on before this rank "
                "posted the send it mirrors; post sends before waiting (batch_isend_irecv does)"
            )
        _wait_copy(self.copied)
        return True

    def get_future(self) -> Future:
        fut: Future = Future()
        fut.set_result(self.tensors)
        return fut


class _PendingSendWork(dist.Work):
    """A send posted before its matching receive. ``wait`` snapshots the data, so the sender may reuse it."""

    def __init__(self, entry: list[Tensor]) -> None:
        super().__init__()
        self.entry = entry  # the queued message itself: emptied when a receive takes it
        self.snapshotted = False
        self.copied: dist.Work | None = None  # the link stream's copy, once a receive took the message

    def is_completed(self) -> bool:
        return self.copied is None or self.copied.is_completed()

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if self.entry and not self.snapshotted:
            # Still unmatched: keep a private copy (costs memory only for blocking send-then-recv patterns).
            self.entry[:] = [t.clone() for t in self.entry]
            self.snapshotted = True
        # Taken by a receive on the link stream: the sender may write its tensors once that copy read them.
        _wait_copy(self.copied)
        return True

    def get_future(self) -> Future:
        fut: Future = Future()
        fut.set_result(self.entry)
        return fut


def _reduce_in_place(t: Tensor, op: Any, world: int) -> None:
    """``t`` becomes the reduction of ``world`` copies of itself."""
    kind = getattr(op, "op", op)  # a ReduceOp object from the options, or a bare RedOpType
    ops = dist.ReduceOp
    if kind == ops.SUM:
        t.mul_(world)
    elif kind == ops.PRODUCT:
        t.pow_(world)
    elif kind == ops.BXOR:
        if world % 2 == 0:
            t.zero_()
    elif not any(kind == keep for keep in (ops.MAX, ops.MIN, ops.AVG, ops.BAND, ops.BOR)):
        raise StandinError(
            f"stand-in group: reduce op {kind} is not modeled; use SUM, AVG, MAX, MIN, PRODUCT or a bitwise op"
        )


class StandinGroup(PythonProcessGroup):
    """Rank ``rank`` of a ``size``-rank group whose peers are copies of this rank (module docstring).

    Each collective takes the arguments of ``torch.distributed.ProcessGroup``'s method of that name and returns
    a completed ``Work``.
    """

    def __init__(self, rank: int, size: int, link_stream: bool = False, link_ctas: int = 0,
                 link_high_priority: bool = False) -> None:
        super().__init__(rank, size, BACKEND)
        # (peer, tag) -> queued messages: sends waiting for the receive that mirrors them, and receives
        # waiting for their send. A receive from src mirrors the send to (2r - src) mod N.
        self._sends: dict[tuple[int, int], deque[_PendingSendWork]] = defaultdict(deque)
        self._recvs: dict[tuple[int, int], deque[_PendingRecvWork]] = defaultdict(deque)
        self.link_stream, self.link_ctas, self.link_high_priority = link_stream, link_ctas, link_high_priority
        self._links: dict[torch.device, _LinkStream] = {}

    def drop_pending(self) -> int:
        """Forget unmatched sends and receives (after a failure mid-transfer); how many there were."""
        n = sum(len(q) for q in self._sends.values()) + sum(len(q) for q in self._recvs.values())
        self._sends.clear()
        self._recvs.clear()
        return n

    def _mirror(self, peer: int) -> int:
        """The peer whose message to this rank equals this rank's message to ``peer``'s mirror."""
        return (2 * self._rank - peer) % self._size

    # --- point to point -------------------------------------------------------------------------------

    def _copy(self, outs: list[Tensor], ins: list[Tensor]) -> dist.Work | None:
        """One matched message: ``outs`` take ``ins``, on the link stream where the group has one (its work
        returned), else now on the compute stream (None: done as far as the caller's stream is concerned)."""
        link = self._link(outs[0].device) if outs else None
        if link is None:
            for out, t in zip(outs, ins, strict=True):
                out.copy_(t)
            return None
        return link.copy(outs, ins)

    def _link(self, device: torch.device) -> _LinkStream | None:
        """The stream this group's copies on ``device`` run on (``link_stream`` and CUDA), made on first use."""
        if not (self.link_stream and device.type == "cuda"):
            return None
        link = self._links.get(device)
        if link is None:
            link = self._links[device] = _LinkStream(device, self.link_ctas, self.link_high_priority)
        return link

    @_skip_frame
    def send(self, tensors: list[Tensor], dst: int, tag: int = 0) -> dist.Work:
        key = (dst, tag)
        if self._recvs[key]:
            pending = self._recvs[key].popleft()
            pending.copied = self._copy(pending.tensors, tensors)
            pending.done = True
            return pending.copied or _DONE
        work = _PendingSendWork(list(tensors))
        self._sends[key].append(work)
        return work

    @_skip_frame
    def recv(self, tensors: list[Tensor], src: int, tag: int = 0) -> dist.Work:
        key = (self._mirror(src), tag)
        if self._sends[key]:
            sent = self._sends[key].popleft()
            sent.copied = self._copy(list(tensors), list(sent.entry))
            sent.entry.clear()
            return sent.copied or _DONE
        work = _PendingRecvWork(list(tensors), src, tag)
        self._recvs[key].append(work)
        return work

    def recv_anysource(self, tensors: list[Tensor], tag: int = 0) -> dist.Work:
        raise StandinError("stand-in group: receive from any source is not modeled; name the source rank")

    def _start_coalescing(self, device: torch.device) -> None:
        pass

    def _end_coalescing(self, device: torch.device) -> dist.Work:
        return completed_work()

    # --- all-to-all -----------------------------------------------------------------------------------

    @torch.compiler.disable
    def all_to_all_single(
        self, output: Tensor, input: Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist.Work:
        n = self._size
        out_splits = list(output_split_sizes) or [output.shape[0] // n] * n
        in_splits = list(input_split_sizes) or [input.shape[0] // n] * n
        mirror = [self._mirror(s) for s in range(n)]
        if any(out_splits[s] != in_splits[mirror[s]] for s in range(n)):
            raise StandinError(
                f"stand-in group {self._name!r}: all-to-all output splits {out_splits} do not mirror input splits "
                f"{in_splits} (output chunk s is input chunk (2r - s) mod N); take the output splits from an "
                "all-to-all of the counts on this group"
            )
        outs = output.split(out_splits)
        ins = input.split(in_splits)
        for s in range(n):
            if outs[s].numel():
                outs[s].copy_(ins[mirror[s]])
        return completed_work([output])

    alltoall_base = all_to_all_single

    @torch.compiler.disable
    def alltoall(self, output_tensors: list[Tensor], input_tensors: list[Tensor], opts: Any = None) -> dist.Work:
        for s, out in enumerate(output_tensors):
            out.copy_(input_tensors[self._mirror(s)])
        return completed_work(output_tensors)

    # --- gathers and reductions -----------------------------------------------------------------------

    @torch.compiler.disable
    def all_gather_single(self, output: Tensor, input: Tensor, opts: Any = None) -> dist.Work:
        output.view(self._size, -1).copy_(input.reshape(1, -1))
        return completed_work([output])

    _allgather_base = all_gather_single

    @torch.compiler.disable
    def allgather(self, output_tensors: list[list[Tensor]], input_tensors: list[Tensor], opts: Any = None) -> dist.Work:
        for outs, inp in zip(output_tensors, input_tensors, strict=True):
            for out in outs:
                out.copy_(inp)
        return completed_work(output_tensors)

    @torch.compiler.disable
    def allreduce(self, tensors: list[Tensor], opts: Any = None) -> dist.Work:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for t in tensors:
            _reduce_in_place(t, op, self._size)
        return completed_work(tensors)

    @torch.compiler.disable
    def reduce_scatter_single(self, output: Tensor, input: Tensor, opts: Any = None) -> dist.Work:
        output.copy_(input.reshape(self._size, *output.shape)[self._rank])
        _reduce_in_place(output, opts.reduceOp if opts is not None else dist.ReduceOp.SUM, self._size)
        return completed_work([output])

    _reduce_scatter_base = reduce_scatter_single

    @torch.compiler.disable
    def reduce_scatter(self, outputs: list[Tensor], input_lists: list[list[Tensor]], opts: Any = None) -> dist.Work:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for out, inputs in zip(outputs, input_lists, strict=True):
            out.copy_(inputs[self._rank])
            _reduce_in_place(out, op, self._size)
        return completed_work(outputs)

    def broadcast(self, tensors: list[Tensor], opts: Any = None) -> dist.Work:
        return completed_work(tensors)

    def barrier(self, opts: Any = None) -> dist.Work:
        return completed_work()

    def monitored_barrier(self, *args: Any, **kwargs: Any) -> None:
        pass


def _attach_fake_backend(pg: StandinGroup, rank: int, size: int) -> None:
    """C++ paths with no Python override (``*_out`` variants, coalescing) land on a ``FakeProcessGroup``."""
    try:
        from torch._C._distributed_c10d import FakeProcessGroup

        create = getattr(FakeProcessGroup, "_create_internal", None)
        fake = create(rank, size) if create is not None else FakeProcessGroup(rank, size)
        for device in ("cpu", "cuda"):
            pg._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, fake)
    except Exception as e:  # only a convenience: the Python overrides carry everything the bench uses
        log.debug("stand-in group: no FakeProcessGroup backend attached: %s", e)


def _create(store: Any, rank: int, size: int, timeout: Any) -> StandinGroup:
    pg = StandinGroup(rank, size)
    _attach_fake_backend(pg, rank, size)
    return pg


def _ensure_world(size: int = _WORLD_SIZE) -> None:
    """Register the backend and start the stand-in world (rank 0 of ``size``) once per process."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
    if dist.is_initialized():
        world = dist.group.WORLD
        if not isinstance(world, StandinGroup):
            raise StandinError(
                f"standin_group: torch.distributed is already initialized with {type(world).__name__}; the stand-in "
                "needs a process of its own (call it before init_process_group, or destroy that group first)"
            )
        return
    dist.init_process_group(BACKEND, rank=0, world_size=size, store=dist.HashStore())
    # torch names groups by a counter that restarts with the world; caches keyed by group name (ring specs)
    # must never meet a reused name with another size, so a restarted stand-in world continues the count.
    world_state = dist.distributed_c10d._world
    world_state.group_count = max(world_state.group_count, _names_used)


def standin_group(
    size: int, *, link_stream: bool = False, link_ctas: int = 0, link_high_priority: bool = False
) -> dist.ProcessGroup:
    """The stand-in EP group of ``size`` ranks in which this process is rank 0 (cached per size, ``link_stream``:
    point-to-point copies on a stream of their own, ``link_ctas``: with ``link_stream``, each copy by that many
    thread blocks, as NCCL's channels, and ``link_high_priority``: with ``link_stream``, that stream of the
    highest priority, as NCCL's streams with ``is_high_priority_stream``; module docstring).

    Raises:
        ValueError: ``size`` outside ``[1, 4096]``, or ``link_ctas`` negative, or it or ``link_high_priority``
            set without ``link_stream``.
        StandinError: torch.distributed already runs another backend in this process.
    """
    if not 1 <= size <= _WORLD_SIZE:
        raise ValueError(f"standin_group: size must be in [1, {_WORLD_SIZE}], got {size}")
    if link_ctas < 0 or (link_ctas and not link_stream):
        raise ValueError(f"standin_group: link_ctas={link_ctas} needs link_stream=True and a count >= 0 (0: the "
                         "copies are Tensor.copy_)")
    if link_high_priority and not link_stream:
        raise ValueError("standin_group: link_high_priority=True needs link_stream=True (without it the copies "
                         "run on the compute stream)")
    key = (size, link_stream, link_ctas, link_high_priority)
    group = _GROUPS.get(key)
    if group is None:
        _ensure_world()
        group = dist.new_group(ranks=list(range(size)), backend=BACKEND)
        assert isinstance(group, StandinGroup), f"standin_group: new_group returned {type(group).__name__}"
        group.link_stream, group.link_ctas, group.link_high_priority = link_stream, link_ctas, link_high_priority
        _GROUPS[key] = group
        log.debug("stand-in group of %d ranks: %r", size, group)
    return group


def standin_world(size: int) -> dist.ProcessGroup:
    """Make the default process group a stand-in world of ``size`` ranks, this process rank 0; returns it.

    For code that builds its device mesh from the world (torchtitan's ``ParallelDims.build_mesh`` calls
    ``init_device_mesh``, which needs ``world_size`` ranks): it then runs unmodified, its subgroups created on
    the stand-in backend. A running stand-in world of another size is torn down first (``destroy_standin_groups``:
    groups handed out before are invalid after that). ``standin_group(n)`` for ``n <= size`` keeps working.

    Raises:
        ValueError: ``size`` outside ``[1, 4096]``.
        StandinError: torch.distributed already runs another backend in this process.
    """
    if not 1 <= size <= _WORLD_SIZE:
        raise ValueError(f"standin_world: size must be in [1, {_WORLD_SIZE}], got {size}")
    if dist.is_initialized() and isinstance(dist.group.WORLD, StandinGroup) and dist.get_world_size() != size:
        destroy_standin_groups()
    _ensure_world(size)
    assert dist.get_world_size() == size, f"standin_world: the world has {dist.get_world_size()} ranks, not {size}"
    return dist.group.WORLD


def drop_pending_messages() -> int:
    """``drop_pending`` on every stand-in group: call after an error (an out-of-memory inside a ring leaves
    a posted send without its receive, which a later run would otherwise take). Returns how many were dropped."""
    return sum(g.drop_pending() for g in _GROUPS.values() if isinstance(g, StandinGroup))


def destroy_standin_groups() -> None:
    """Tear down the stand-in world and its groups, so ``dist.is_initialized()`` is False again.

    A later ``standin_group`` starts a new world whose groups get names not used before in this process.
    """
    global _names_used
    if dist.is_initialized() and isinstance(dist.group.WORLD, StandinGroup):
        _names_used = max(_names_used, dist.distributed_c10d._world.group_count)
        dist.destroy_process_group()
    _GROUPS.clear()

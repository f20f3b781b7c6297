"""Ring transport: one hop's asynchronous P2P transfer, sent to the next rank and received from the previous.

Every transfer of a ring program is a ``RingTransfer``: ``start`` posts the sends and receives of a payload
(several tensors in one batch, as ``batch_isend_irecv`` posts them; where circulating tensors and trailing
accumulators travel together, the accumulators in a batch of their own posted first, which ``wait_trailing``
waits for alone), ``wait`` blocks until both sides complete and returns the receive buffers. All ranks run the same
program, so they post the same transfers in the same order; tags keep concurrent transfers to the same peer
apart (gloo matches by tag, NCCL by order).

Receive buffers come in groups, each group views of one buffer (``receive_buffers``, laid out by ``_layout``):
the circulating tensors, the trailing accumulators (two groups, so that each keeps its own lifetime: a hop's
weights must not hold the sums beside them alive). A payload that a rank forwards as it arrived (weights
moving on, token partitions, the sums a hop added into in place) is then the whole buffer of a group, and
travels as one send and one receive per group instead of one per tensor: at EP=64 that removes about half of
a step's P2P operations (docs/BENCHMARKS.md). Which tensors travel as a group's buffer (``_spans``) depends
only on which tensors the program passes, which every rank's program decides alike, and is used only where
the payload and the receive buffers split alike, so the two sides of each transfer agree (a payload of fresh
tensors, such as the local weights at hop 0, goes per tensor).

A program runs inside a ``RingRun`` (one op call), which

- tracks every transfer posted and not yet waited on: if an exception leaves the program, each of them is
  waited on before it leaves the op (torch offers no way to cancel a posted P2P op), so no buffer is
  freed under a pending receive;
- adds a status element to every transfer (of a schedule with trailing accumulators: only they carry what
  other ranks computed, so expert routing's forward has none): 0, or ``1 + r`` for the highest rank ``r``
  this rank has heard of failing inside the ring, so the news travels with the data. A rank whose hop
  compute fails *drains*
  (``hop_compute``: later hops compute nothing, transfers go on), so the ranks never stop posting, and
  ``outcome`` raises its own error once the ring is done. A rank that received anything sent after the
  failure (its results may depend on the missing hops) raises ``RingPeerError`` naming the failing rank:
  at the end of the op where the status is a CPU tensor (gloo), and otherwise at its next call on the group,
  where the agreement's exchange carries the status (``runtime.agreement``) and every rank raises alike:
  reading it at the end of the op would add a device-to-host sync to every ring. (A backward's exchange, which
  does not wait for the compute stream, carries it only once computed: else a later call raises.) A rank that received
  nothing sent after the failure returns normally: its results do not depend on the failed hops.

Timeouts: a transfer waits as long as the process group's timeout (``init_process_group(timeout=...)``).
A peer that stops without draining (an error outside hop compute, or a dead process) leaves its neighbours
waiting until then, or until the backend notices (gloo reports a closed connection at once);
``RingTransportError`` then names the neighbours of the failed transfer.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch._prims_common import make_contiguous_strides_for

from relay_compile.runtime.cost_model import INTER_NODE_GBPS, NVLINK_GBPS

# Tags of one transfer are ``index * TAGS_PER_TRANSFER + position``: room for every tensor of a payload.
TAGS_PER_TRANSFER = 64
# The status element of transfer ``index`` travels under ``STATUS_TAG + index``: above every payload tag.
STATUS_TAG = 1 << 24


class RingTransportError(RuntimeError):
    """A transfer or exchange of the ring failed in the backend (a peer stopped, died, or timed out)."""


class RingPeerError(RuntimeError):
    """Another rank failed inside the ring, and this rank received data sent after that failure."""


@dataclass(frozen=True, kw_only=True)
class RingGroup:
    """The EP group as a ring: this rank, its size, and the global ranks of its two neighbours."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    next_global: int
    prev_global: int

    @staticmethod
    def resolve(group_name: str) -> RingGroup:
        """The ring of a process group by name; ``""`` is a ring of one (no communication)."""
        if not group_name:
            return RingGroup(group=None, rank=0, size=1, next_global=0, prev_global=0)
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(group_name)
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        return RingGroup(
            group=group,
            rank=rank,
            size=size,
            next_global=dist.get_global_rank(group, (rank + 1) % size),
            prev_global=dist.get_global_rank(group, (rank - 1) % size),
        )


@dataclass(kw_only=True)
class HopFailure:
    """This rank's first failure inside a run, and where it happened."""

    error: Exception
    where: str


class RingRun:
    """One program run (one op call): its posted transfers, its failure, the failure status it has heard.

    Used as a context manager around building the step and running the program: the transport and the hop
    compute find it with ``active_run()``.
    """

    def __init__(self, ring: RingGroup, device: torch.device, label: str, *, carries_status: bool = True) -> None:
        self.ring, self.label = ring, label
        self.posted: list[RingTransfer] = []
        self.failure: HopFailure | None = None
        # Failure status, (1,) int64: 0, or 1 + the highest failing rank heard of. ``heard`` is the status the
        # latest posted transfer waited on brought, ``own`` this rank's (None until it fails); the run's status is their
        # maximum (``status``). Both None: a ring of one, or a schedule in which no rank's results depend on
        # what another rank computes.
        with_status = carries_status and ring.size > 1
        self.heard = torch.zeros(1, dtype=torch.int64, device=device) if with_status else None
        # Transfers are numbered in the order they are posted (every rank posts in the program's order, which is
        # not always the order of their indices: remat=False posts the replay ring's first); ``heard`` is from
        # the latest posted one waited on so far, so one waited on out of order does not count.
        self.num_posted = 0
        self.heard_seq = -1
        self.own: Tensor | None = None
        self._token: contextvars.Token | None = None

    def __enter__(self) -> RingRun:  # noqa: PYI034 -- final in effect
        self._token = _ACTIVE_RUN.set(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        assert self._token is not None
        _ACTIVE_RUN.reset(self._token)
        if exc is not None:
            self._settle(exc)

    @property
    def drains(self) -> bool:
        """Whether a hop failure drains (peers to keep posting for) instead of raising at once."""
        return self.ring.size > 1

    def fail(self, error: Exception, where: str) -> None:
        """Record this rank's failure (the first one counts); later transfers carry it to the peers."""
        if self.failure is None:
            self.failure = HopFailure(error=error, where=where)
            if self.heard is not None:
                self.own = torch.full_like(self.heard, self.ring.rank + 1)

    @property
    def status(self) -> Tensor | None:
        """The status this rank sends on: the maximum of its own and the last one it received.

        The last one received is enough: every rank sends a status that never decreases (its own is set once,
        and by induction what it receives never decreases), so the status of the previous rank's latest posted
        transfer (``seq``, whatever order the program waits in) is the highest it sent. No merge runs per
        transfer unless this rank failed.
        """
        if self.heard is None or self.own is None:
            return self.heard
        return torch.maximum(self.own, self.heard)

    def _settle(self, error: BaseException) -> None:
        """An exception leaves the program: wait on every transfer still posted, so none is left pending."""
        for xfer in list(self.posted):
            try:
                xfer.wait()
            except Exception as e:  # noqa: BLE001 -- it failed as well: the original error is the one to raise
                _note(error, f"relay_compile: transfer {xfer.index} of rank {self.ring.rank} could not complete "
                             f"after it ({e})")
        self.posted.clear()

    def outcome(self) -> Tensor | None:
        """After the program: raise this rank's own failure; then the status heard from the peers, read at once
        where reading is free (``RingPeerError``), else returned unread for the group's next agreement."""
        assert not self.posted, "ring transport: a program returned with transfers still posted"
        if self.failure is not None:
            _note(self.failure.error, (
                f"relay_compile: rank {self.ring.rank} failed in {self.failure.where} of the {self.label} ring; it "
                "completed the ring's remaining transfers (computing nothing) so that no peer waits on it"
            ))
            raise self.failure.error
        status = self.status
        if status is None or not status_read_at_once(status.device):
            return status
        failed = int(status.item()) - 1
        if failed >= 0:
            raise RingPeerError(peer_failure(failed, self.ring.rank, f"this {self.label} ring"))
        return None


def status_read_at_once(device: torch.device) -> bool:
    """Whether a run's failure status is read at the end of the op: only where that is no device sync."""
    return device.type == "cpu"


def recorded_event(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded on ``device``'s current stream now (None off CUDA): whether what was queued before it
    is done (``query``), without a sync."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


@functools.cache
def _exchange_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


@contextlib.contextmanager
def beside_compute(device: torch.device, after_queued: bool = False) -> Iterator[None]:
    """Run a small exchange on a stream of its own (CUDA; elsewhere as it is): its collective then waits for
    nothing queued on the compute stream after it (NCCL's stream waits for the current one), and reading its
    result syncs that stream only. The group's collectives stay in the order they were issued (NCCL runs them on
    its own stream). The tensors it reads must be ready without the compute stream: host values, or device ones
    whose event is done; ``after_queued``: or computed by the work queued on the compute stream so far, which the
    exchange then waits for (and for nothing queued after it)."""
    if device.type != "cuda":
        yield
        return
    stream = _exchange_stream(device)
    if after_queued:
        stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield


def peer_failure(failed: int, rank: int, where: str) -> str:
    """The message of ``RingPeerError``: ``rank`` received data sent after ``failed`` failed in ``where``."""
    return (
        f"ring_moe: rank {failed} of the EP group failed inside {where}, and rank {rank} received data it sent "
        f"after that, so rank {rank}'s results of it may be wrong (rank {failed} raised the cause; every "
        "transfer completed, the group stays usable)"
    )


_ACTIVE_RUN: contextvars.ContextVar[RingRun | None] = contextvars.ContextVar("relaymoe_ring_run", default=None)


def active_run() -> RingRun | None:
    """The ``RingRun`` in progress on this thread, if any (a step driven directly has none)."""
    return _ACTIVE_RUN.get()


def _note(error: BaseException, note: str) -> None:
    if hasattr(error, "add_note"):  # Python >= 3.11
        error.add_note(note)


@dataclass(kw_only=True, eq=False)  # compared by identity: the run removes exactly this one
class RingTransfer:
    """One posted transfer: the send tensors stay referenced until ``wait`` so they are not freed early."""

    sent: list[Tensor]
    received: list[Tensor]
    works: list[dist.Work] = field(default_factory=list)
    index: int = 0
    seq: int = 0  # the run's count of transfers posted before this one (``RingRun.heard``)
    ring: RingGroup | None = None
    run: RingRun | None = None
    status_in: Tensor | None = None
    done: bool = False
    stride: int = 1
    # The works of the accumulators' batch, posted first (``start_transfer``'s ``trailing_from``), the first of
    # ``works``; empty: one batch. ``trailing_arrived``: ``wait_trailing`` waited for them.
    trailing_works: list[dist.Work] = field(default_factory=list)
    trailing_from: int = 0
    trailing_arrived: bool = False

    def wait_trailing(self) -> tuple[Tensor, ...]:
        """Block until the trailing accumulators' batch completes; their receive buffers (``received[first:]``,
        ``first`` the number of circulating tensors). A transfer posted as one batch waits for all of it."""
        if self.done or self.trailing_arrived:
            return tuple(self.received[self.trailing_from:])
        if not self.trailing_works:
            return self.wait()[self.trailing_from:]
        try:
            for work in self.trailing_works:
                work.wait()
        except RuntimeError as e:
            raise RingTransportError(self._failed(e)) from e
        finally:
            # Never waited again (``wait``, a failed run's ``_settle``): a gloo work waited twice waits for a
            # second completion that never comes.
            self.works = self.works[len(self.trailing_works):]
            self.trailing_works = []
        self.trailing_arrived = True
        # The status travels in this batch: heard now, as ``wait`` would (a later transfer of the program may be
        # posted before this one's ``wait``, and must carry what this one brought).
        self._hear(self.run)
        return tuple(self.received[self.trailing_from:])

    def _hear(self, run: RingRun | None) -> None:
        """Record the status this transfer brought as the run's latest heard (if it is the latest posted)."""
        if run is not None and self.status_in is not None and self.seq > run.heard_seq:
            run.heard, run.heard_seq = self.status_in, self.seq

    def wait(self) -> tuple[Tensor, ...]:
        """Block until both sides complete; the receive buffers. Waiting again returns them at once (a hop
        that sums into a transfer's arrivals waits on it before the program's own wait)."""
        if self.done:
            return tuple(self.received)
        run, self.run = self.run, None
        if run is not None:
            run.posted.remove(self)
        try:
            for work in self.works:
                work.wait()
        except RuntimeError as e:
            raise RingTransportError(self._failed(e)) from e
        self.sent, self.done = [], True
        self._hear(run)
        return tuple(self.received)

    def _failed(self, e: Exception) -> str:
        r = self.ring
        assert r is not None
        peers = (
            f"receiving from global rank {r.prev_global}, sending to global rank {r.next_global}" if self.stride == 1
            else f"receiving from group rank {(r.rank - self.stride) % r.size}, sending to group rank "
                 f"{(r.rank + self.stride) % r.size}"
        )
        return (
            f"ring_moe: transfer {self.index} of rank {r.rank} ({peers}) failed: {e}. A neighbour that stopped "
            "outside hop compute or died leaves this rank here until the backend notices or the process group's "
            "timeout"
        )


def start_transfer(
    ring: RingGroup, index: int, payload: list[Tensor], receive: list[Tensor], *, stride: int = 1,
    trailing_from: int | None = None,
) -> RingTransfer:
    """Post ``payload`` to the rank ``stride`` on and ``receive`` (preallocated, contiguous) from the one ``stride``
    back (1: the next and the previous rank).

    ``trailing_from``: where a payload of both circulating tensors and trailing accumulators (``receive``'s
    groups split there too) starts its accumulators. They are posted first, as a batch of their own: the hop
    that posts the transfer adds into the accumulators it receives (``RingTransfer.wait_trailing``), while the
    circulating tensors are needed only at the next hop. A link moves one batch after the other (NCCL's stream,
    the stand-in's link stream), so the accumulators arrive in their own time instead of the whole payload's.

    Inside a ``RingRun`` the transfer also carries the run's failure status (with the accumulators, whose
    values are what other ranks computed) and is tracked until waited on.
    """
    assert len(payload) == len(receive) <= TAGS_PER_TRANSFER, "ring transport: payload and receive disagree"
    sent = [t.contiguous() for t in payload]
    if ring.size == 1:
        return RingTransfer(sent=[], received=sent)
    split = trailing_from if trailing_from is not None and 0 < trailing_from < len(sent) else 0
    circulating = _tagged_ops(index, 0, sent[:split], receive[:split]) if split else []
    trailing = _tagged_ops(index, len(circulating) // 2, sent[split:], receive[split:])
    run = active_run()
    status_in = None
    status_out = run.status if run is not None else None
    if status_out is not None:
        # Never written in place (a received status or a merge is a tensor of its own): sent as it is.
        status_in = torch.empty_like(status_out)
        sent.append(status_out)
        trailing += [(True, status_out, STATUS_TAG + index), (False, status_in, STATUS_TAG + index)]
    device = receive[0].device
    works = _post(ring, device, trailing, stride)
    trailing_works = list(works) if split else []
    if circulating:
        works += _post(ring, device, circulating, stride)
    xfer = RingTransfer(sent=sent, received=receive, works=works, index=index,
                        seq=run.num_posted if run is not None else 0, ring=ring, run=run, status_in=status_in,
                        stride=stride, trailing_works=trailing_works, trailing_from=split)
    if run is not None:
        run.num_posted += 1
        run.posted.append(xfer)
    return xfer


def _tagged_ops(
    index: int, first_pos: int, sent: list[Tensor], receive: list[Tensor]
) -> list[tuple[bool, Tensor, int]]:
    """``(is_send, tensor, tag)`` for one batch of transfer ``index``: each span (``_spans``) sent and received
    under tag ``index * TAGS_PER_TRANSFER + pos``, positions from ``first_pos`` on."""
    send_spans, recv_spans = _spans(sent), _spans(receive)
    # Decided by structure only, never by sizes: each rank decides for its own sends and receives, and sizes
    # differ across ranks (token routing receives another source's partition than it sends), while the
    # program's structure is every rank's. Across one link the sizes agree: both sides lay out the same specs.
    pairs = (
        [(s, r) for (_, s), (_, r) in zip(send_spans, recv_spans)]
        if [n for n, _ in send_spans] == [n for n, _ in recv_spans]
        else zip(sent, receive, strict=True)
    )
    ops: list[tuple[bool, Tensor, int]] = []
    for pos, (send_t, recv_t) in enumerate(pairs, start=first_pos):
        tag = index * TAGS_PER_TRANSFER + pos
        ops += [(True, send_t, tag), (False, recv_t, tag)]
    return ops


def _post(
    ring: RingGroup, device: torch.device, ops: Sequence[tuple[bool, Tensor, int]], stride: int = 1
) -> list[dist.Work]:
    """Post ``(is_send, tensor, tag)`` ops to the rank ``stride`` on / from the one ``stride`` back: what
    ``dist.batch_isend_irecv`` posts (the same backend calls in the same order, coalesced into one group where the
    backend coalesces, NCCL), without its per-op Python (``P2POp`` objects, group and rank checks, rank
    translation): the ring posts two transfers per hop, and at EP=64 that Python was a tenth of a step's host
    time."""
    group = ring.group
    assert group is not None, "ring transport: a ring of more than one rank has a group"
    coalesced = _coalesces(group, device)
    if coalesced:
        group._start_coalescing(device)
    dst, src = (ring.rank + stride) % ring.size, (ring.rank - stride) % ring.size
    works = [group.send([t], dst, tag) if is_send else group.recv([t], src, tag) for is_send, t, tag in ops]
    return [group._end_coalescing(device)] if coalesced else works


def _coalesces(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``batch_isend_irecv`` would coalesce on this group (its test, torch 2.11 and 2.13): a C++ group
    whose backend for ``device`` coalesces (NCCL); a Python group (the stand-in) or gloo posts op by op."""
    return type(group) is dist.ProcessGroup and group._get_backend(device).supports_coalescing


# Byte alignment of each tensor in a receive buffer: any element type's, and the width of vector loads.
_ALIGN = 16


def _layout(specs: Sequence[tuple[Sequence[int], torch.dtype]]) -> tuple[list[int], int]:
    """Byte offsets of tensors of these shapes and dtypes packed in one buffer, and the bytes they span."""
    offsets, end = [], 0
    for shape, dtype in specs:
        start = -(-end // _ALIGN) * _ALIGN
        offsets.append(start)
        end = start + math.prod(shape) * dtype.itemsize
    return offsets, end


@dataclass(frozen=True)
class _BufferPlan:
    """How ``receive_buffers`` lays out one group of specs: the buffer's dtype and length, and per tensor its
    shape, contiguous strides and element offset (a buffer of the tensors' dtype where they share one, so
    each view is one ``as_strided``; else bytes, each view a slice reinterpreted)."""

    dtype: torch.dtype
    numel: int
    views: tuple[tuple[tuple[int, ...], tuple[int, ...], int, torch.dtype], ...]


@functools.lru_cache(maxsize=512)
def _buffer_plan(specs: tuple[tuple[tuple[int, ...], torch.dtype], ...]) -> _BufferPlan:
    offsets, nbytes = _layout(specs)
    dtypes = {dtype for _, dtype in specs}
    unit = next(iter(dtypes)) if len(dtypes) == 1 else torch.uint8
    views = tuple(
        (tuple(shape), tuple(make_contiguous_strides_for(shape)), off // unit.itemsize, dtype)
        for (shape, dtype), off in zip(specs, offsets, strict=True)
    )
    return _BufferPlan(dtype=unit, numel=nbytes // unit.itemsize, views=views)


class _Group:
    """A ``receive_buffers`` group: its buffer, and how many views it has. Each view carries ``(group, position)``
    as ``_ring_group``, so a payload forwarded as it arrived is found to be the whole group (``_spans``)
    without reading addresses."""

    __slots__ = ("buffer", "size")

    def __init__(self, buffer: Tensor, size: int) -> None:
        self.buffer, self.size = buffer, size


def receive_buffers(
    specs: Sequence[tuple[Sequence[int], torch.dtype]], device: torch.device, *, flat: bool = True
) -> list[Tensor]:
    """Uninitialized receive buffers of these shapes and dtypes: views of one buffer (module docstring);
    ``flat=False``: separate tensors (what becomes an op's outputs must not alias)."""
    if not flat or len(specs) <= 1:
        return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]
    plan = _buffer_plan(tuple((tuple(shape), dtype) for shape, dtype in specs))
    buffer = torch.empty(plan.numel, dtype=plan.dtype, device=device)
    group = _Group(buffer, len(plan.views))
    views = []
    for pos, (shape, strides, offset, dtype) in enumerate(plan.views):
        if dtype == plan.dtype:
            view = buffer.as_strided(shape, strides, offset)
        else:
            nbytes = math.prod(shape) * dtype.itemsize
            view = buffer[offset : offset + nbytes].view(dtype).view(shape)
        view._ring_group = (group, pos)  # type: ignore[attr-defined]
        views.append(view)
    return views


def _spans(tensors: Sequence[Tensor]) -> list[tuple[int, Tensor]]:
    """``tensors`` as what can travel: ``(count, tensor)`` with the buffer of every whole ``receive_buffers``
    group among them, in order (count: the views it stands for), and every other tensor by itself.

    It depends only on which tensors the program passes, which every rank's program decides alike; a transfer
    sends spans only where its payload and its receive buffers split alike, so both sides of it agree (a
    payload of fresh tensors, such as the local weights at hop 0, goes per tensor).
    """
    spans: list[tuple[int, Tensor]] = []
    i = 0
    while i < len(tensors):
        tag = getattr(tensors[i], "_ring_group", None)
        if tag is not None and tag[1] == 0:
            group = tag[0]
            n = group.size
            if i + n <= len(tensors) and all(
                getattr(t, "_ring_group", None) == (group, j) for j, t in enumerate(tensors[i : i + n])
            ):
                spans.append((n, group.buffer))
                i += n
                continue
        spans.append((1, tensors[i]))
        i += 1
    return spans


def link_gbps(group: dist.ProcessGroup | None, option: float | str = "auto") -> float | None:
    """The bandwidth (GB/s, one direction) the cost model takes one hop's transfer on ``group`` to see; None:
    transfers are device copies (no link).

    ``option`` (``RingOptions.link_gbps``) wins where it is a number. ``"auto"``: NCCL moves data over device
    links: an NVLink-class one within a node (``NVLINK_GBPS``), a network between nodes (``INTER_NODE_GBPS``,
    one 400 Gb/s NIC per GPU; pass the real figure where it differs) where the group spans nodes
    (``spans_nodes``). Any other group has no device link to model: the one-GPU stand-in
    (``bench.standin_group``) copies on the device, which is how the calibration measured it; gloo runs on the
    CPU, where the model does not decide. The group decides with the slowest link any rank reports
    (``decision.agreed_link``).
    """
    if option != "auto":
        return float(option)
    if group is None:
        return None
    try:
        backend = str(dist.get_backend(group))
    except (RuntimeError, ValueError):  # a group torch.distributed does not know by a backend name
        return None
    if "nccl" not in backend.lower():
        return None
    return INTER_NODE_GBPS if spans_nodes(dist.get_process_group_ranks(group)) else NVLINK_GBPS


def spans_nodes(global_ranks: Sequence[int]) -> bool:
    """Whether these global ranks live on more than one node, as torchrun places them: ``LOCAL_WORLD_SIZE``
    consecutive global ranks per node. Unknown (no ``LOCAL_WORLD_SIZE``, as outside torchrun): False."""
    try:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    except ValueError:
        return False
    return per_node > 0 and len({r // per_node for r in global_ranks}) > 1


def group_link_gbps(group_name: str, option: float | str = "auto") -> float | None:
    """``link_gbps`` of the group named ``group_name`` (``""``: a ring of one): what a compile-time decision of
    a region on that group predicts with, as its ring op will at every call."""
    return link_gbps(RingGroup.resolve(group_name).group, option)


def all_gather_rows(ring: RingGroup, row_R: Tensor) -> Tensor:
    """Every rank's ``row_R`` stacked ``(N, R)``: the step's one small exchange (``runtime.agreement``).

    Every rank must pass a row of the same length (gloo aborts the process otherwise).
    """
    if ring.size == 1:
        return row_R[None]
    # Flat output: gloo's all-gather rejects a 2-D output tensor.
    out = row_R.new_empty(ring.size * row_R.numel())
    # all_gather_single is 2.13's name; 2.11 (our GPU machines) only has all_gather_into_tensor.
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    try:
        gather(out, row_R.contiguous(), group=ring.group)
    except RuntimeError as e:
        raise RingTransportError(
            f"ring_moe: the step's agreement exchange failed on rank {ring.rank}: {e}. A rank that did not reach "
            "this call (it stopped before it, or its calls are out of step) leaves the others here until the "
            "process group's timeout"
        ) from e
    return out.view(ring.size, -1)


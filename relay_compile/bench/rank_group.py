"""The process group of ranks run as threads (``bench.rank_threads``): what its ranks share and how data moves.

The ranks of one group share an ``_Exchange``:

- point to point: a send and its receive (same src, dst and tag, matched in posting order) are joined by
  whichever is posted second, which enqueues the copy on the receiver's *link stream* after both posters'
  streams reached their post (CUDA events); ``wait`` blocks until they are joined, then orders the caller's
  stream after the copy. A send may be waited on only once its receive is posted (as NCCL's rendezvous).
- collectives: a rendezvous, in each rank's call order: the last rank to join does every rank's part (on
  each destination's link stream, after every rank's post), then each rank's stream is ordered after all of
  it, so a rank may reuse its inputs at once. Collectives are synchronous on the host (as gloo's are).
- a rank that raises fails the run (``RankRun``): every rank waiting in the group raises ``RankThreadsError`` at
  once, and a wait longer than the run's ``timeout`` raises it naming the rank, peer and operation.

``RankThreadGroup`` is a Python ``ProcessGroup`` (as the stand-in is), registered as backend ``BACKEND``, whose
factory finds the run in progress (``activated``).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from relay_compile.bench.python_group import PythonProcessGroup, completed_work

__all__ = ["BACKEND", "RankRun", "RankThreadGroup", "RankThreadsError", "activated"]

BACKEND = "relaymoe_threads"
_POLL_S = 0.02  # how often a waiting rank looks for a failed peer
_ACTIVE: RankRun | None = None  # the run in progress (its groups' exchanges)


class RankThreadsError(RuntimeError):
    """A rank of a thread-ranks run failed, waited past the timeout, or called the group inconsistently."""


# ----------------------------------------------------------------------------------------------------------
# The exchange: what the ranks of one group share
# ----------------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Post:
    """One rank's side of a transfer or collective: its tensors, and (CUDA) its stream at the post."""

    rank: int
    tensors: list[Tensor]
    stream: torch.cuda.Stream | None
    ready: torch.cuda.Event | None
    joined: threading.Event = field(default_factory=threading.Event)
    copied: list[torch.cuda.Event] = field(default_factory=list)  # the caller's stream waits on these


def _post(rank: int, tensors: Sequence[Tensor]) -> _Post:
    cuda = next((t.device for t in tensors if t.is_cuda), None)
    if cuda is None:
        return _Post(rank, list(tensors), None, None)
    stream = torch.cuda.current_stream(cuda)
    ready = torch.cuda.Event()
    ready.record(stream)
    return _Post(rank, list(tensors), stream, ready)


@dataclass(eq=False)
class _Round:
    """One collective in progress: its kind, and the posts of the ranks that joined."""

    kind: str
    posts: dict[int, tuple[_Post, Any]] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    copied: list[torch.cuda.Event] = field(default_factory=list)
    error: tuple[int, BaseException] | None = None  # the rank that ran it, and how it failed


class RankRun:
    """One ``run_rank_threads``: its store, timeout, failures, results, and the exchanges of its groups."""

    def __init__(self, size: int, timeout: float) -> None:
        self.size, self.timeout = size, timeout
        self.store = dist.HashStore()
        self.exchanges: dict[str, _Exchange] = {}
        self.lock = threading.Lock()
        self.failures: dict[int, BaseException] = {}
        self.results: list[Any] = [None] * size

    def exchange(self, token: str, size: int) -> _Exchange:
        with self.lock:
            if token not in self.exchanges:
                self.exchanges[token] = _Exchange(self, size)
            return self.exchanges[token]

    def fail(self, rank: int, error: BaseException) -> None:
        with self.lock:
            self.failures.setdefault(rank, error)

    def check(self, rank: int, what: str, deadline: float) -> None:
        """Raise where another rank failed or the wait for ``what`` outlived the timeout."""
        if self.failures and rank not in self.failures:
            failed = min(self.failures)
            raise RankThreadsError(f"rank {rank}: {what} cannot complete: rank {failed} failed "
                                   f"({type(self.failures[failed]).__name__}: {self.failures[failed]})")
        if time.monotonic() > deadline:
            raise RankThreadsError(f"rank {rank}: {what} waited more than {self.timeout:g} s (the run's timeout)")

    def wait(self, event: threading.Event, rank: int, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not event.wait(_POLL_S):
            self.check(rank, what, deadline)


class _Exchange:
    """Pending sends and receives and collectives in progress of one group (all its ranks)."""

    def __init__(self, run: RankRun, size: int) -> None:
        self.run, self.size = run, size
        self.lock = threading.Lock()
        self.sends: dict[tuple[int, int, int], deque[_Post]] = defaultdict(deque)
        self.recvs: dict[tuple[int, int, int], deque[_Post]] = defaultdict(deque)
        self.rounds: dict[int, _Round] = {}
        self.links: dict[int, torch.cuda.Stream] = {}
        self._links_lock = threading.Lock()

    def link(self, rank: int, device: torch.device) -> torch.cuda.Stream:
        """``rank``'s link stream: where the copies into its tensors run (as a NIC's engine would)."""
        with self._links_lock:  # P2P joins hold ``lock``, a collective's last rank does not
            if rank not in self.links:
                self.links[rank] = torch.cuda.Stream(device)
            return self.links[rank]

    # --- point to point ---------------------------------------------------------------------------------

    def post_p2p(self, send: bool, key: tuple[int, int, int], post: _Post) -> None:
        """Queue ``post`` (a send or a receive of ``key = (src, dst, tag)``), or join it with its peer's."""
        mine, theirs = (self.sends, self.recvs) if send else (self.recvs, self.sends)
        with self.lock:
            if not theirs[key]:
                mine[key].append(post)
                return
            other = theirs[key].popleft()
            sent, received = (post, other) if send else (other, post)
            self._transfer(sent, received, key)

    def _transfer(self, sent: _Post, received: _Post, key: tuple[int, int, int]) -> None:
        src, dst, tag = key
        shapes = [(t.shape, t.dtype) for t in sent.tensors], [(t.shape, t.dtype) for t in received.tensors]
        if shapes[0] != shapes[1]:
            raise RankThreadsError(f"rank {src} sends {shapes[0]} to rank {dst} (tag {tag}), which receives "
                                   f"{shapes[1]}: post matching sends and receives")
        with torch.no_grad(), self._on_link(dst, [sent, received]) as events:
            for out, t in zip(received.tensors, sent.tensors, strict=True):
                out.copy_(t)
        sent.copied, received.copied = events, events
        sent.joined.set()
        received.joined.set()

    # --- collectives ------------------------------------------------------------------------------------

    def collective(self, seq: int, kind: str, post: _Post, args: Any, work: Callable[[_Exchange, dict], None]) -> None:
        """Join collective number ``seq`` of this group; the last rank to join runs ``work`` for every rank.
        Returns once it ran, this rank's stream ordered after all of its copies."""
        with self.lock:
            rnd = self.rounds.setdefault(seq, _Round(kind))
            if rnd.kind != kind:
                other = next(iter(rnd.posts))
                raise RankThreadsError(f"rank {post.rank} calls {kind} as collective #{seq} of its group, rank "
                                       f"{other} called {rnd.kind}: every rank must call the same collectives "
                                       "in the same order")
            rnd.posts[post.rank] = (post, args)
            last = len(rnd.posts) == self.size
            if last:
                del self.rounds[seq]
        if last:
            try:
                work(self, rnd)
            except BaseException as e:
                rnd.error = (post.rank, e)
                raise
            finally:
                rnd.done.set()
        self.run.wait(rnd.done, post.rank, f"{kind} (collective #{seq} of its group)")
        if rnd.error is not None:
            raise RankThreadsError(f"rank {post.rank}: {kind} (collective #{seq} of its group) failed on rank "
                                   f"{rnd.error[0]}: {rnd.error[1]}")
        _order_after(post, rnd.copied)

    @contextlib.contextmanager
    def _on_link(self, dst: int, posts: Sequence[_Post]) -> Iterator[list[torch.cuda.Event]]:
        """Within: the current stream is ``dst``'s link stream, after every post's stream reached its post;
        yields the list that then holds the event recorded after the body (CUDA; empty on the CPU)."""
        events: list[torch.cuda.Event] = []
        streams = [p for p in posts if p.stream is not None]
        if not streams:
            yield events
            return
        link = self.link(dst, streams[0].stream.device)
        with torch.cuda.stream(link):
            for p in streams:
                link.wait_event(p.ready)
            yield events
            done = torch.cuda.Event()
            done.record(link)
            for p in streams:  # a rank may drop a tensor before the copy ran: its block waits for the link
                for t in p.tensors:
                    if t.is_cuda:
                        t.record_stream(link)
        events.append(done)


def _order_after(post: _Post, events: Sequence[torch.cuda.Event]) -> None:
    if post.stream is not None:
        stream = torch.cuda.current_stream(post.stream.device)
        for e in events:
            stream.wait_event(e)


# ----------------------------------------------------------------------------------------------------------
# Collectives: each runs, for every destination rank, that rank's part on its link stream
# ----------------------------------------------------------------------------------------------------------


def _reduce(tensors: Sequence[Tensor], op: Any) -> Tensor:
    """The reduction of ``tensors`` (rank order) by ``op`` (a ``ReduceOp`` or its ``RedOpType``), a new tensor."""
    kind = getattr(op, "op", op)
    ops = dist.ReduceOp
    acc = tensors[0].clone()
    table = {ops.SUM: torch.add, ops.AVG: torch.add, ops.PRODUCT: torch.mul, ops.MAX: torch.maximum,
             ops.MIN: torch.minimum, ops.BAND: torch.bitwise_and, ops.BOR: torch.bitwise_or,
             ops.BXOR: torch.bitwise_xor}
    fn = next((f for k, f in table.items() if kind == k), None)
    if fn is None:
        raise RankThreadsError(f"thread ranks: reduce op {kind} is not supported")
    for t in tensors[1:]:
        acc = fn(acc, t)
    if kind == ops.AVG:
        acc = acc / len(tensors) if acc.is_floating_point() else acc // len(tensors)
    return acc


def _each_destination(ex: _Exchange, rnd: _Round, part: Callable[[int, list[Any]], None]) -> None:
    """``part(dst, args_by_rank)`` for every rank, on its link stream after every rank's post."""
    posts = [rnd.posts[r][0] for r in range(ex.size)]
    args = [rnd.posts[r][1] for r in range(ex.size)]
    with torch.no_grad():
        for dst in range(ex.size):
            with ex._on_link(dst, posts) as events:
                part(dst, args)
            rnd.copied.extend(events)


def _all_to_all_single(ex: _Exchange, rnd: _Round) -> None:
    def part(dst: int, args: list[Any]) -> None:
        out, _, out_splits, _ = args[dst]
        outs = out.split(out_splits)
        for src, (_, inp, _, in_splits) in enumerate(args):
            chunk = inp.split(in_splits)[dst]
            if outs[src].shape != chunk.shape:
                raise RankThreadsError(f"all-to-all: rank {dst} expects {tuple(outs[src].shape)} from rank {src}, "
                                       f"which sends {tuple(chunk.shape)}: output splits must equal the senders' "
                                       "input splits")
            outs[src].copy_(chunk)
    _each_destination(ex, rnd, part)


def _all_to_all(ex: _Exchange, rnd: _Round) -> None:
    _each_destination(ex, rnd, lambda dst, args: [o.copy_(args[src][1][dst]) for src, o in enumerate(args[dst][0])])


def _all_gather_single(ex: _Exchange, rnd: _Round) -> None:
    def part(dst: int, args: list[Any]) -> None:
        out = args[dst][0]
        for chunk, (_, inp) in zip(out.view(-1).split(out.numel() // ex.size), args, strict=True):
            chunk.copy_(inp.reshape(-1))
    _each_destination(ex, rnd, part)


def _all_gather(ex: _Exchange, rnd: _Round) -> None:
    def part(dst: int, args: list[Any]) -> None:
        for i, outs in enumerate(args[dst][0]):
            for src, out in enumerate(outs):
                out.copy_(args[src][1][i])
    _each_destination(ex, rnd, part)


def _all_reduce(ex: _Exchange, rnd: _Round) -> None:
    """In place: the results are reduced once (on rank 0's link stream), then copied to every rank, so no
    rank's tensor is overwritten before every rank's has been read."""
    posts = [rnd.posts[r][0] for r in range(ex.size)]
    args = [rnd.posts[r][1] for r in range(ex.size)]
    with torch.no_grad():
        with ex._on_link(0, posts) as reduced:
            results = [_reduce([a[0][i] for a in args], args[0][1]) for i in range(len(args[0][0]))]
        # The copies wait for the reduction: a post standing for it, on rank 0's link stream.
        after = [_Post(0, results, ex.links[0], reduced[0])] if reduced else []
        for dst in range(ex.size):
            with ex._on_link(dst, after) as events:
                for t, r in zip(args[dst][0], results, strict=True):
                    t.copy_(r)
            rnd.copied.extend(events)


def _reduce_scatter_single(ex: _Exchange, rnd: _Round) -> None:
    def part(dst: int, args: list[Any]) -> None:
        out, _, op = args[dst]
        out.copy_(_reduce([inp.reshape(ex.size, *out.shape)[dst] for _, inp, _ in args], op))
    _each_destination(ex, rnd, part)


def _reduce_scatter(ex: _Exchange, rnd: _Round) -> None:
    def part(dst: int, args: list[Any]) -> None:
        outs, _, op = args[dst]
        for i, out in enumerate(outs):
            out.copy_(_reduce([inputs[i][dst] for _, inputs, _ in args], op))
    _each_destination(ex, rnd, part)


def _broadcast(ex: _Exchange, rnd: _Round) -> None:
    def part(dst: int, args: list[Any]) -> None:
        root = args[dst][1]
        if dst != root:
            for t, s in zip(args[dst][0], args[root][0], strict=True):
                t.copy_(s)
    _each_destination(ex, rnd, part)


# ----------------------------------------------------------------------------------------------------------
# The process group
# ----------------------------------------------------------------------------------------------------------


class _Work(dist.Work):
    """A posted send or receive: ``wait`` blocks until its peer's side is posted, then orders the stream."""

    def __init__(self, exchange: _Exchange, post: _Post, what: str) -> None:
        super().__init__()
        self.exchange, self.post, self.what = exchange, post, what

    def is_completed(self) -> bool:
        return self.post.joined.is_set()

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        self.exchange.run.wait(self.post.joined, self.post.rank, self.what)
        _order_after(self.post, self.post.copied)
        return True

    def get_future(self) -> torch.futures.Future:
        self.wait()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self.post.tensors)
        return fut


class RankThreadGroup(PythonProcessGroup):
    """Rank ``rank`` of a group whose ranks are threads of this process (module docstring). Each operation takes
    the arguments of ``torch.distributed.ProcessGroup``'s method of that name, in group ranks."""

    def __init__(self, rank: int, size: int, exchange: _Exchange) -> None:
        super().__init__(rank, size, BACKEND)
        self._exchange = exchange
        self._seq = itertools.count()

    # --- point to point -------------------------------------------------------------------------------

    @torch.compiler.disable
    def send(self, tensors: list[Tensor], dst: int, tag: int = 0) -> dist.Work:
        post = _post(self._rank, tensors)
        self._exchange.post_p2p(True, (self._rank, dst, tag), post)
        return _Work(self._exchange, post, f"send to rank {dst} (tag {tag})")

    @torch.compiler.disable
    def recv(self, tensors: list[Tensor], src: int, tag: int = 0) -> dist.Work:
        post = _post(self._rank, tensors)
        self._exchange.post_p2p(False, (src, self._rank, tag), post)
        return _Work(self._exchange, post, f"receive from rank {src} (tag {tag})")

    def recv_anysource(self, tensors: list[Tensor], tag: int = 0) -> dist.Work:
        raise RankThreadsError("thread ranks: receive from any source is not supported; name the source rank")

    def _start_coalescing(self, device: torch.device) -> None:
        pass

    def _end_coalescing(self, device: torch.device) -> dist.Work:
        return completed_work(None)

    # --- collectives ----------------------------------------------------------------------------------

    def _collective(self, kind: str, tensors: Sequence[Tensor], args: Any, work: Callable, result: Any) -> dist.Work:
        self._exchange.collective(next(self._seq), kind, _post(self._rank, tensors), args, work)
        return completed_work(result)

    @torch.compiler.disable
    def all_to_all_single(self, output: Tensor, input: Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: Any = None) -> dist.Work:
        n = self._size
        out_splits = list(output_split_sizes) or [output.shape[0] // n] * n
        in_splits = list(input_split_sizes) or [input.shape[0] // n] * n
        return self._collective("all_to_all", [output, input], (output, input, out_splits, in_splits),
                                _all_to_all_single, [output])

    alltoall_base = all_to_all_single

    @torch.compiler.disable
    def alltoall(self, output_tensors: list[Tensor], input_tensors: list[Tensor], opts: Any = None) -> dist.Work:
        return self._collective("alltoall", [*output_tensors, *input_tensors], (output_tensors, input_tensors),
                                _all_to_all, output_tensors)

    @torch.compiler.disable
    def all_gather_single(self, output: Tensor, input: Tensor, opts: Any = None) -> dist.Work:
        return self._collective("all_gather", [output, input], (output, input), _all_gather_single, [output])

    _allgather_base = all_gather_single

    @torch.compiler.disable
    def allgather(self, output_tensors: list[list[Tensor]], input_tensors: list[Tensor], opts: Any = None) -> dist.Work:
        flat = [*itertools.chain.from_iterable(output_tensors), *input_tensors]
        return self._collective("allgather", flat, (output_tensors, input_tensors), _all_gather, output_tensors)

    @torch.compiler.disable
    def allreduce(self, tensors: list[Tensor], opts: Any = None) -> dist.Work:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._collective("allreduce", tensors, (tensors, op), _all_reduce, tensors)

    @torch.compiler.disable
    def reduce_scatter_single(self, output: Tensor, input: Tensor, opts: Any = None) -> dist.Work:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._collective("reduce_scatter", [output, input], (output, input, op), _reduce_scatter_single,
                                [output])

    _reduce_scatter_base = reduce_scatter_single

    @torch.compiler.disable
    def reduce_scatter(self, outputs: list[Tensor], input_lists: list[list[Tensor]], opts: Any = None) -> dist.Work:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        flat = [*outputs, *itertools.chain.from_iterable(input_lists)]
        return self._collective("reduce_scatter_list", flat, (outputs, input_lists, op), _reduce_scatter, outputs)

    @torch.compiler.disable
    def broadcast(self, tensors: list[Tensor], opts: Any = None) -> dist.Work:
        root = opts.rootRank if opts is not None else 0
        return self._collective("broadcast", tensors, (tensors, root), _broadcast, tensors)

    @torch.compiler.disable
    def barrier(self, opts: Any = None) -> dist.Work:
        return self._collective("barrier", [], None, lambda ex, rnd: None, None)

    def monitored_barrier(self, *args: Any, **kwargs: Any) -> None:
        self.barrier()


def _create(store: Any, rank: int, size: int, timeout: Any) -> RankThreadGroup:
    """The backend's factory: this thread's rank of the group whose (prefix) store is ``store``."""
    run = _ACTIVE
    if run is None:
        raise RankThreadsError(f"the {BACKEND!r} backend runs inside run_rank_threads only")
    # Every rank of one group gets the same token: the first to ask sets it in the group's store.
    token = store.compare_set("relaymoe_exchange", "", uuid.uuid4().hex).decode()
    return RankThreadGroup(rank, size, run.exchange(token, size))


@contextlib.contextmanager
def activated(run: RankRun) -> Iterator[None]:
    """Within: groups created on the backend belong to ``run`` (registers the backend once per process)."""
    global _ACTIVE
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
    _ACTIVE = run
    try:
        yield
    finally:
        _ACTIVE = None

"""agreement: what every rank of a ring must agree on, settled by one small exchange per op call.

Contract:
    Every call of a ring op, forward or backward, runs ``agree`` once before it posts any transfer: one
    all-gather of an int64 row per rank whose length depends only on state every rank shares (never on the
    arguments, the spec or this rank's history), so every rank always takes the same collective path.
    The row carries this rank's *claims*: a local problem (an argument that failed a check, or any error
    before the exchange: code, argument and the first bytes of the message), the direction, token count,
    hidden size, top-k, the dtypes of everything that travels (x, topk_ids, topk_scores, grad_y), experts
    per rank, weight count, shapes and dtypes, the options that change the transfer schedule (routing asked,
    overlap, remat, fp32_accumulation, fp8; never ``max_hop_rows``, a per-rank memory knob), the option ``ring``,
    the link this rank's hops cross (``transport.link_gbps``: not checked alike, the slowest one counts), the expert
    function's
    identity (``fn_identity``) and where the scores apply (before or after it), then what the step needs: a
    bad-expert-id flag and the pair counts per expert, and
    the failure status this rank's previous ring on the group left unread (``transport.RingRun.outcome``).
    Every rank checks the gathered table in the same order and raises the same ``RingInputError``, naming the
    rank and the argument (``RingPeerError`` for a previous ring's failure); the rank whose own argument
    failed raises its own error. ``routing="auto"`` is resolved from the table at every call (the same on
    every rank).

Every exchange is gathered beside the compute stream and read as soon as it is done (``_read``). A forward's row
is computed on the device, so its exchange waits for the work queued before it (the counts), and for none queued
after it: the call queues its count-free work there before it reads (``runtime.queued_ahead``). A backward's row
is the same but built on the host, from the counts its forward agreed on (``ops``: the forward op's ``counts_E``
output): its exchange waits for no work queued since the forward. A previous ring's status travels in it only
once computed (else in a later exchange; the table decides what every rank raises, so late is still alike).

Pair counts travel in the same row when they fit the group's counts capacity (the largest expert count an
agreed call of this group has had, shared state that grows identically on every rank); the first call of a
group (or of a larger expert count) sends none, and then token routing runs a second all-gather of the
agreed length, while expert routing reads its own counts locally. A row of a length that differs across
ranks is never sent: gloo aborts the process on one.

``fail_together`` is the same exchange for a rank that failed before reaching the op (``ring_moe``'s own
checks): it sends a row with its problem and raises with the others.

Legend: N ranks, E experts in the group, E_l experts per rank, T tokens, H hidden, K top-k.
"""

from __future__ import annotations

import functools
import operator
import weakref
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from relay_compile.routing import ROUTINGS, Routing, per_hop_bytes
from relay_compile.runtime import decision
from relay_compile.runtime.cost_model import Choice, Execution
from relay_compile.runtime.decision import BlockSizes
from relay_compile.runtime.ring_options import RINGS, RingOptions
from relay_compile.runtime.transport import (
    RingGroup,
    RingPeerError,
    all_gather_rows,
    beside_compute,
    peer_failure,
    recorded_event,
)

Direction = str  # "forward" | "backward" (programs.schedule spells it the same)

# Arguments a problem can name; a problem's code is 1 + the index. "the call" is any other local error.
ARGUMENTS = (
    "x", "topk_ids", "topk_scores", "weights", "w1", "w2", "w3", "grad_y", "experts_per_rank", "expert_fn",
    "name", "activation", "use_grouped_mm", "routing", "overlap", "remat", "max_hop_rows", "fp32_accumulation",
    "scores_applied", "ring", "fp8", "link_gbps", "save_projections", "gather_in_gemm", "add_in_gemm",
    "the call",
)
# Dtypes as small codes (any fixed numbering works: every rank uses this table); others by a stable CRC.
_DTYPES = (
    None, torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
)
MAX_WEIGHTS, MAX_DIMS = 6, 4  # weights described field by field; more weights or dims: a digest only
MESSAGE_WORDS = 16  # a problem's message: its first 128 bytes travel with it
_WEIGHT_FIELDS = ("dtype", "ndim", *(f"d{i}" for i in range(MAX_DIMS)))
_HEADER = (
    "problem", "direction", "tokens", "hidden", "top_k", "x_dtype", "ids_dtype", "scores_dtype", "grad_dtype",
    "experts_per_rank", "routing", "overlap", "remat", "fp32_accumulation", "ring", "fp8", "link", "cuda", "machine", "kept",
    "saves",
    "expert_fn", "scores_before", "num_weights", "weights_digest",
    *(f"w{i}.{f}" for i in range(MAX_WEIGHTS) for f in _WEIGHT_FIELDS), "counts_len",
    *(f"message{i}" for i in range(MESSAGE_WORDS)),
)
_AT = {name: i for i, name in enumerate(_HEADER)}
# From the device, after the header: the bad-id flag, the previous ring's unread failure status, the counts.
BAD_IDS = len(_HEADER)
PEER_FAILURE = BAD_IDS + 1
COUNTS = BAD_IDS + 2

# What every rank must pass alike, in the order they are checked: (field, what it is, how to print a value).
_AGREED = (
    ("experts_per_rank", "experts per rank (experts_per_rank, or w1.shape[0])", str),
    ("expert_fn", "the expert function (expert_fn and name=; code shown is a digest)", lambda v: f"#{v:x}"),
    ("scores_before", "where the scores apply (scores_applied)", lambda v: "before" if v else "after"),
    ("routing", "option routing", lambda v: repr(ROUTINGS[v])),
    ("overlap", "option overlap", lambda v: str(bool(v))),
    ("remat", "option remat", lambda v: str(bool(v))),
    ("fp32_accumulation", "option fp32_accumulation", lambda v: str(bool(v))),
    ("ring", "option ring", lambda v: repr(RINGS[v])),
    ("fp8", "option fp8", lambda v: str(bool(v))),
    ("cuda", "the tokens' device type (x.device)", lambda v: "cuda" if v else "not cuda"),
    ("hidden", "the hidden size (x.shape[1])", str),
    ("top_k", "top-k (topk_ids.shape[1])", str),
    ("x_dtype", "x's dtype", lambda v: dtype_name(v)),
    ("ids_dtype", "topk_ids' dtype", lambda v: dtype_name(v)),
    ("scores_dtype", "topk_scores' dtype", lambda v: dtype_name(v)),
    ("grad_dtype", "grad_y's dtype", lambda v: dtype_name(v)),
)


class RingInputError(ValueError):
    """The ranks' inputs failed the step's agreement; raised on every rank before any transfer is posted."""


class BadArgument(ValueError):
    """An argument that failed a local check; ``argument`` names it (one of ``ARGUMENTS``)."""

    def __init__(self, argument: str, message: str) -> None:
        assert argument in ARGUMENTS, argument
        super().__init__(message)
        self.argument = argument


def dtype_code(dtype: torch.dtype | None) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else 1000 + zlib.crc32(str(dtype).encode()) % 10**6


def dtype_name(code: int) -> str:
    return str(_DTYPES[code]) if 0 < code < len(_DTYPES) else ("none" if code == 0 else f"dtype#{code}")


@dataclass(frozen=True, kw_only=True)
class Claims:
    """This rank's side of the agreement (with a ``problem``, the other fields may stay empty)."""

    direction: Direction = "forward"
    problem: Exception | None = None
    tokens: int = 0
    hidden: int = 0
    top_k: int = 0
    dtypes: tuple[torch.dtype | None, ...] = (None, None, None, None)  # x, topk_ids, topk_scores, grad_y
    experts_per_rank: int = 0
    options: RingOptions = field(default_factory=RingOptions)
    expert_fn: int = 0
    scores_before: bool = False
    weights: tuple[tuple[torch.dtype, tuple[int, ...]], ...] = ()
    cuda: bool = False
    machine: int = 0  # ``cost_model.calibration_code`` of the tokens' device: the group decides with rank 0's
    link_gbps: float | None = None  # ``transport.link_gbps`` of the option and the group (None: device copies)
    # 1: the region kept its all-to-all at compile time, 2: it was refused (``agree_kept``); 3: a graph compiled
    # twice chooses its kept or its ring variant (``agree_tokens``)
    kept: int = 0
    # The op can save the expert ring's first projections (``ops.ring_moe_saving``): 1 where the cost model
    # decided so before the call (``save_projections="auto"``), 2 where the option says True; 0: it cannot. The
    # call saves where every rank can and the expert ring runs (``Agreement.saves``): a rank-local knob, not
    # checked alike.
    saves: int = 0

    def header(self, counts_len: int) -> list[int]:
        if self.problem is None:
            return list(_cached_header(self, counts_len))
        return self._header(counts_len)

    def _header(self, counts_len: int) -> list[int]:
        row = dict.fromkeys(_HEADER, 0)
        if self.problem is not None:
            row["problem"] = 1 + ARGUMENTS.index(getattr(self.problem, "argument", "the call"))
            row |= dict(zip([f"message{i}" for i in range(MESSAGE_WORDS)], _encode(str(self.problem)), strict=True))
        row |= dict(
            direction=int(self.direction == "backward"), tokens=self.tokens, hidden=self.hidden, top_k=self.top_k,
            experts_per_rank=self.experts_per_rank, routing=ROUTINGS.index(self.options.routing),
            overlap=int(self.options.overlap), remat=int(self.options.remat),
            fp32_accumulation=int(self.options.fp32_accumulation), ring=RINGS.index(self.options.ring),
            fp8=int(self.options.fp8), link=round(self.link_gbps * 1000) if self.link_gbps else 0,
            cuda=int(self.cuda), machine=self.machine, kept=int(self.kept), saves=self.saves, expert_fn=self.expert_fn,
            scores_before=int(self.scores_before),
            num_weights=len(self.weights), counts_len=counts_len,
        )
        row |= zip(("x_dtype", "ids_dtype", "scores_dtype", "grad_dtype"), map(dtype_code, self.dtypes), strict=True)
        row |= _weight_fields(self.weights)
        return list(row.values())


@functools.lru_cache(maxsize=256)
def _cached_header(claims: Claims, counts_len: int) -> tuple[int, ...]:
    """A step's claims repeat call after call: their header is built once (never one with a problem: its
    exception would stay alive here)."""
    return tuple(claims._header(counts_len))


def _weight_fields(weights: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> dict[str, int]:
    """Each weight's dtype, rank and sizes, or (too many to list) a digest of them all."""
    if len(weights) > MAX_WEIGHTS or any(len(shape) > MAX_DIMS for _, shape in weights):
        return {"weights_digest": 1 + zlib.crc32(repr([(str(d), s) for d, s in weights]).encode())}
    fields: dict[str, int] = {}
    for i, (dtype, shape) in enumerate(weights):
        dims = [*shape, *[0] * (MAX_DIMS - len(shape))]
        fields |= dict(zip([f"w{i}.{f}" for f in _WEIGHT_FIELDS], [dtype_code(dtype), len(shape), *dims], strict=True))
    return fields


def _encode(message: str) -> list[int]:
    raw = message.encode()[: 8 * MESSAGE_WORDS].ljust(8 * MESSAGE_WORDS, b"\0")
    return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw), 8)]


def _decode(words: Sequence[int]) -> str:
    raw = b"".join(w.to_bytes(8, "little", signed=True) for w in words)
    return raw.rstrip(b"\0").decode(errors="ignore")


@dataclass(frozen=True, kw_only=True)
class StepCounts:
    """What a step plans its chunks from: every rank's token count and pairs per global expert.

    ``counts_NE[r]`` is None for a rank whose counts this rank was not sent (expert routing needs its own only).
    """

    tokens_N: list[int]
    counts_NE: list[list[int] | None]


@dataclass(frozen=True, kw_only=True)
class Agreement:
    """The agreed call: what it runs as (``execution``: a ring's routing, ``auto`` resolved, or the block's
    all-to-all), its counts, the per-hop volumes, and the cost model's predictions where it decided (CUDA)."""

    routing: Routing
    execution: Execution
    counts: StepCounts
    volumes: dict[str, dict[str, int]]
    choice: Choice | None = None
    # The expert ring's forward saves the first projections for its backward (``ops.ring_moe_saving``): both
    # directions of a call read the same agreed values, so they agree on it.
    saves: bool = False


@dataclass(kw_only=True)
class _GroupState:
    counts_cap: int = 0  # counts travel in the row when the group's expert count fits (same on every rank)
    # The failure status of the group's previous rings, where it was not read at once, and an event recorded
    # after it (accelerators): an exchange that does not wait for the compute stream sends it only once done.
    unread_status: Tensor | None = None
    unread_done: torch.cuda.Event | None = None

    def take_status(self, waiting: bool) -> Tensor | None:
        """The unread status for this exchange (None: nothing to send), or, where the exchange does not wait
        for the compute stream (``waiting`` False) and the status is not computed yet, None and keep it for a
        later exchange: the table decides what every rank raises, so a status sent late is raised late but alike."""
        status = self.unread_status
        if status is None or not (waiting or self.unread_done is None or self.unread_done.query()):
            return None
        self.unread_status = self.unread_done = None
        return status


def remember_status(ring: RingGroup, status: Tensor | None) -> None:
    """Keep a ring's unread failure status (``transport.RingRun.outcome``) for the group's next exchange,
    merged with one still unread (statuses never decrease: the highest failing rank heard of)."""
    if status is None or ring.group is None:
        return
    state = _group_state(ring)
    if state.unread_status is not None:
        status = torch.maximum(state.unread_status.to(status.device), status)
    state.unread_status = status
    state.unread_done = recorded_event(status.device)


_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _group_state(ring: RingGroup) -> _GroupState:
    return _GROUPS.setdefault(ring.group, _GroupState()) if ring.group is not None else _GroupState()


def agree(
    ring: RingGroup, claims: Claims, bad_ids: Tensor, counts_E: Tensor, weight_bytes: int, elem_bytes: int,
    grad_bytes: int, sum_elem_bytes: int, sizes: BlockSizes | None = None, counts_agreed: bool = False,
    before_read: Callable[[], None] | None = None,
) -> Agreement:
    """The exchange of one op call; raises ``RingInputError`` (or this rank's own problem) on every rank.

    ``bad_ids``: ``(1,)`` int64 flag of ids outside ``[0, E)`` (on the group's device); ``counts_E``: int64 pairs
    per expert (device).
    ``weight_bytes``, ``elem_bytes``: this rank's weight bytes and token element size; ``grad_bytes``,
    ``sum_elem_bytes``: the same for the sums that travel (``routing.per_hop_bytes``), for ``routing="auto"``.
    ``sizes``: for the cost model (``decision.decide``; None: routing by bytes, and the ring, as without a model).
    ``counts_agreed``: ``counts_E`` are on the host, as an earlier agreement on these routing arguments read them
    (a backward's, from its forward): the row then holds nothing the device computes, and the exchange does not
    wait for the compute stream (``_exchange``). The table is the same either way.
    ``before_read``: queues the caller's work that needs no count on the compute stream, after the exchange was
    posted and before the host waits for it (``runtime.queued_ahead``).
    """
    state = _group_state(ring)
    table = _exchange(ring, claims, bad_ids, counts_E, state, counts_agreed, before_read)
    _check(ring, claims, table)
    e = len(counts_E)
    counts_NE: list[list[int] | None] = [row[COUNTS : COUNTS + e] if row[_AT["counts_len"]] else None for row in table]
    head = table[0]
    volume_args = dict(
        tokens=max(row[_AT["tokens"]] for row in table), hidden=head[_AT["hidden"]], top_k=head[_AT["top_k"]],
        experts_per_rank=head[_AT["experts_per_rank"]], elem_bytes=elem_bytes,
        expert_bytes=weight_bytes // max(1, head[_AT["experts_per_rank"]]),
        expert_grad_bytes=grad_bytes // max(1, head[_AT["experts_per_rank"]]), sum_elem_bytes=sum_elem_bytes,
    )
    tokens_N = [row[_AT["tokens"]] for row in table]
    cal = decision.agreed_calibration(head[_AT["machine"]]).with_link(
        decision.agreed_link([row[_AT["link"]] for row in table]))
    # Every rank runs a saving op (each claims 1 or 2): each decided before the call that this call saves and
    # holds the projections' buffer already, so the group saves wherever the expert ring runs (as under True);
    # deciding again from the group's largest T could only waste that buffer.
    saving = 2 if min(row[_AT["saves"]] for row in table) else 0
    execution, choice = decision.decide(ROUTINGS[head[_AT["routing"]]], RINGS[head[_AT["ring"]]],
                                        bool(head[_AT["cuda"]]), volume_args, tokens_N, ring.size, sizes, cal, saving)
    if counts_NE[ring.rank] is None:
        # NOTE: the group's first call with this many experts: counts did not fit the row.
        counts_NE = (all_gather_rows(ring, counts_E.to(bad_ids.device)).tolist() if execution == "token"
                     else _own(ring, counts_E))
    state.counts_cap = max(state.counts_cap, e)
    return Agreement(
        routing="expert" if execution == "all_to_all" else execution, execution=execution, choice=choice,
        counts=StepCounts(tokens_N=tokens_N, counts_NE=counts_NE),
        volumes={mode: per_hop_bytes(mode, **volume_args) for mode in ("expert", "token")},
        saves=execution == "expert" and (choice.saves if choice is not None else saving == 2),
    )


def _own(ring: RingGroup, counts_E: Tensor) -> list[list[int] | None]:
    counts_NE: list[list[int] | None] = [None] * ring.size
    counts_NE[ring.rank] = counts_E.tolist()  # NOTE: device-to-host sync
    return counts_NE


def _agree_without_counts(ring: RingGroup, claims: Claims, device: torch.device) -> list[list[int]]:
    """The group's exchange for a call that carries no expert counts (a failure, a kept region, a token switch):
    the table, checked alike on every rank."""
    # Nothing in the row is computed on the device: it is gathered beside the compute stream (``_exchange``), so
    # a kept region's or a token switch's exchange does not wait for the work queued before it.
    # (``bad_ids`` names the group's device only: a host row has no bad ids.)
    no_counts = torch.zeros(0, dtype=torch.int64)
    table = _exchange(ring, claims, torch.zeros(1, dtype=torch.int64, device=device), no_counts, _group_state(ring),
                      counts_agreed=True)
    _check(ring, claims, table)
    return table


def fail_together(ring: RingGroup, problem: Exception, device: torch.device) -> None:
    """Join the op call's exchange with ``problem`` in place of arguments, and raise with every rank."""
    _agree_without_counts(ring, Claims(problem=problem), device)
    raise AssertionError("relay_compile: a problem passed the agreement")  # _check raises on every problem


def _exchange(
    ring: RingGroup, claims: Claims, bad_ids: Tensor, counts_E: Tensor, state: _GroupState,
    counts_agreed: bool = False, before_read: Callable[[], None] | None = None,
) -> list[list[int]]:
    """All-gather ``[header, bad flag, unread status, counts padded to the cap]`` (counts only when they
    fit); the table on the host. Consumes the group's unread status.

    With ``counts_agreed`` (``counts_E`` on the host, as an earlier agreement checked them: no bad ids) that fit the
    row (they do once that agreement ran: the cap only grows), or no counts at all (an exchange that carries none:
    a kept region's, a token switch's), the row is built on the host and gathered beside the compute stream
    (``transport.beside_compute``): reading the table then waits for the exchange only, not for the work queued
    before it (a backward's exchange would otherwise wait for the rest of the forward, the loss and the later
    layers' backward, and the device would idle while this rank plans its hops). The unread status goes with it
    only where it is computed already (``_GroupState.take_status``). Same row, same table as from the device.
    A row computed on the device is gathered beside the compute stream too, after the work queued so far (its
    counts): ``before_read``'s work, queued next, then runs while the host waits for the table (``_read``).
    """
    cap, device = state.counts_cap, bad_ids.device
    fits = 0 < len(counts_E) <= cap
    if not counts_agreed or not (fits or len(counts_E) == 0):
        # Pinned and queued: a pageable copy would sync the stream here, once more before the table's read below.
        header = torch.tensor(claims.header(len(counts_E) if fits else 0), dtype=torch.int64,
                              pin_memory=device.type == "cuda").to(device, non_blocking=True)
        status = state.take_status(waiting=True)
        status = header.new_zeros(1) if status is None else status.to(device)
        counts = counts_E.to(device) if fits else header.new_zeros(0)
        row = torch.cat([header, bad_ids.to(torch.int64).reshape(1), status, counts,
                         header.new_zeros(cap - len(counts))])
        # NOTE: device-to-host sync, once per op call: the table sizes every hop on the host.
        return _read(ring, device, row, before_read)
    counts = counts_E.tolist()
    host = torch.tensor([*claims.header(len(counts)), 0, 0, *counts, *[0] * (cap - len(counts))], dtype=torch.int64,
                        pin_memory=device.type == "cuda")
    status = state.take_status(waiting=False)
    return _read(ring, device, host, before_read, status)


def _read(ring: RingGroup, device: torch.device, row: Tensor, before_read: Callable[[], None] | None,
          status: Tensor | None = None) -> list[list[int]]:
    """Gather ``row`` beside the compute stream, queue ``before_read``, and read the table. ``row`` on the device:
    computed by the work queued so far, which the exchange waits for; on the host: ready, with ``status`` (computed
    already) written into its failure column on the way.

    NOTE: the read waits for this exchange (and, for a device row, what was queued before it), not for
    ``before_read``'s work. Everything that may fail is done before the gather is posted (the pinned buffer the
    table lands in): a rank must not leave between posting it and reading it, or its peers run on without it."""
    cuda = device.type == "cuda"
    host_NR = torch.empty((ring.size, row.numel()), dtype=torch.int64, pin_memory=True) if cuda else None
    with beside_compute(device, after_queued=row.device.type == "cuda"):
        row = row.to(device, non_blocking=True)
        if status is not None:
            row[PEER_FAILURE : PEER_FAILURE + 1].copy_(status)
        if cuda:  # made on the compute stream (a device row), read on this one
            row.record_stream(torch.cuda.current_stream(device))
        table = all_gather_rows(ring, row)
        if host_NR is not None:
            table = host_NR.copy_(table, non_blocking=True)
        done = recorded_event(device)
    if before_read is not None:
        before_read()
    if done is not None:
        done.synchronize()
    return table.tolist()


# The columns that are fine as zeros on every rank, and those every rank must hold alike: one comparison
# each per call when all is well (the usual case), the detailed checks below only otherwise.
_QUIET = operator.itemgetter(_AT["problem"], BAD_IDS, PEER_FAILURE)
_ALIKE = operator.itemgetter(*(i for name, i in _AT.items()
                               if name not in ("problem", "tokens", "counts_len", "link", "machine", "saves")
                               and not name.startswith("message")))


def _check(ring: RingGroup, claims: Claims, table: list[list[int]]) -> None:
    """Raise on every rank alike if the table shows a problem, a disagreement or bad expert ids."""
    alike = _ALIKE(table[0])
    if all(not any(_QUIET(row)) and _ALIKE(row) == alike for row in table):
        return
    _check_problems(ring, claims, table)
    _check_peer_failures(table)
    _check_direction(table)
    _check_kept(table)
    for name, what, show in _AGREED:
        col = _AT[name]
        for rank, row in enumerate(table):
            if row[col] != table[0][col]:
                raise RingInputError(
                    f"ring_moe: the EP group disagrees on {what}: rank {rank} passes {show(row[col])} where rank 0 "
                    f"passes {show(table[0][col])}; every rank must pass the same"
                )
    _check_weights(table)
    _check_bad_ids(ring, table)


def _check_problems(ring: RingGroup, claims: Claims, table: list[list[int]]) -> None:
    failed = [rank for rank, row in enumerate(table) if row[_AT["problem"]]]
    if not failed:
        return
    if claims.problem is not None:
        raise claims.problem
    first = table[failed[0]]
    argument = ARGUMENTS[first[_AT["problem"]] - 1]
    message = _decode(first[_AT["message0"] : _AT["message0"] + MESSAGE_WORDS])
    also = f" (and ranks {failed[1:]})" if len(failed) > 1 else ""
    raise RingInputError(
        f"ring_moe: rank {failed[0]}{also} passed a bad {argument}: {message} -- rank {ring.rank} stops with it so "
        "no rank waits on a transfer"
    )


def _check_peer_failures(table: list[list[int]]) -> None:
    for rank, row in enumerate(table):
        if row[PEER_FAILURE]:
            raise RingPeerError(
                peer_failure(row[PEER_FAILURE] - 1, rank, "its previous ring on this group") + "; every rank "
                "stops at this call, the first exchange since (reading the status earlier would add a sync)"
            )


def _check_column(table: list[list[int]], name: str, names: tuple[str, str], message: str) -> None:
    """Raise if a rank's 0/1 column ``name`` differs from rank 0's: ``message`` formatted with the rank and
    ``names`` of both values."""
    col = _AT[name]
    for rank, row in enumerate(table):
        if row[col] != table[0][col]:
            raise RingInputError(message.format(rank=rank, mine=names[row[col]], first=names[table[0][col]]))


def _check_direction(table: list[list[int]]) -> None:
    _check_column(table, "direction", ("forward", "backward"), (
        "ring_moe: rank {rank} runs a {mine} ring while rank 0 runs a {first} one: the ranks' calls of ring ops "
        "are out of step"))


_KEPT = ("runs the region as a ring", "kept the region's all-to-all (the cost model)",
         "runs the region's all-to-alls (its graph of the block was refused)",
         "chooses between its graph's kept and ring variants (a dynamic token count)")


def _check_kept(table: list[list[int]]) -> None:
    col = _AT["kept"]
    for rank, row in enumerate(table):
        if row[col] == table[0][col]:
            continue
        mine, first = _KEPT[row[col]], _KEPT[table[0][col]]
        pair = {row[col], table[0][col]}
        if 3 in pair and 2 not in pair:
            raise RingInputError(
                f"relaymoe: rank {rank} {mine} while rank 0 {first}: some ranks compiled this graph with a kept "
                "variant (a dynamic token count, option dynamic_keep) and others without. Dynamo's automatic dynamic "
                "shapes recompile a rank with a symbolic token count only once its own count changed, and ranks "
                "may pass different options. Mark the token dimension dynamic on every rank (torch.compile(..., "
                "dynamic=True) or torch._dynamo.mark_dynamic), pass the same options everywhere, or pass "
                "options={'dynamic_keep': False}")
        if 2 in pair:
            raise RingInputError(
                f"relaymoe: rank {rank} {mine} while rank 0 {first}: the ranks compiled different graphs of this "
                "MoE block (a graph break, a warning or a branch on some ranks only; the refusing rank's report "
                "says why). Make every rank trace the same code: TORCH_LOGS=graph_breaks on each rank shows "
                "where they differ")
        raise RingInputError(
            f"relaymoe: rank {rank} {mine} while rank 0 {first}: the backend decided at compile time from each "
            "rank's static token count and link (option link_gbps), and the ranks fall on both sides of the cost "
            "model's threshold. "
            "Give every rank the same token count, mark the token dimension dynamic (then the ranks decide "
            "together at every call), or pass options={'ring': 'always'}")


def agree_kept(ring: RingGroup, device: torch.device, refused: bool = False) -> None:
    """The exchange of a region that runs its all-to-alls (``relaymoe::kept_all_to_all``), before the region's
    first collective: kept at compile time by the cost model, or (``refused``) not rewritten at all. Every rank
    must have done the same (a rank that runs the ring instead is in the same exchange from its op, and all
    raise ``RingInputError``). Reports a previous ring's failure alike (once its status is computed: the exchange
    runs beside the compute stream, ``_exchange``)."""
    _agree_without_counts(ring, Claims(kept=2 if refused else 1), device)


def agree_tokens(ring: RingGroup, device: torch.device, tokens: int) -> list[int]:
    """The exchange of a graph compiled twice (``runtime.token_switch``), before either variant runs: every
    rank's token count, from the group's table, so every rank chooses alike. A rank whose graph differs (it runs
    a ring op or a kept region's exchange instead) meets it in the same exchange, and all raise
    ``RingInputError``. Reports a previous ring's failure alike (once computed, as ``agree_kept``)."""
    table = _agree_without_counts(ring, Claims(kept=3, tokens=tokens), device)
    return [row[_AT["tokens"]] for row in table]


def _check_weights(table: list[list[int]]) -> None:
    for rank, row in enumerate(table):
        for name in ("num_weights", "weights_digest"):
            if row[_AT[name]] != table[0][_AT[name]]:
                raise RingInputError(
                    f"ring_moe: weight shapes of rank {rank} differ from rank 0's: {row[_AT['num_weights']]} "
                    f"weights on rank {rank}, {table[0][_AT['num_weights']]} on rank 0 (or their shapes or dtypes "
                    "differ); every rank must hold expert partitions of one shape"
                )
        for i in range(min(row[_AT["num_weights"]], MAX_WEIGHTS)):
            if _weight(row, i) != _weight(table[0], i):
                raise RingInputError(
                    f"ring_moe: weight shapes of rank {rank} differ from rank 0's: weights[{i}] is "
                    f"{_show_weight(row, i)} on rank {rank}, {_show_weight(table[0], i)} on rank 0; every rank "
                    "must hold expert partitions of one shape and dtype"
                )


def _weight(row: list[int], i: int) -> list[int]:
    start = _AT[f"w{i}.dtype"]
    return row[start : start + len(_WEIGHT_FIELDS)]


def _show_weight(row: list[int], i: int) -> str:
    dtype, ndim, *dims = _weight(row, i)
    return f"{tuple(dims[:ndim])} {dtype_name(dtype)}"


def _check_bad_ids(ring: RingGroup, table: list[list[int]]) -> None:
    bad = [rank for rank, row in enumerate(table) if row[BAD_IDS]]
    if bad:
        num_experts = table[0][_AT["experts_per_rank"]] * ring.size
        raise_bad_ids(ring.rank, num_experts, bad)


def raise_bad_ids(rank: int, num_experts: int, bad_ranks: Sequence[int]) -> None:
    """Every rank raises once any rank holds expert ids outside ``[0, E)``; the rank holding them says so."""
    if rank in bad_ranks:
        raise RingInputError(f"ring_moe: topk_ids holds expert ids outside [0, {num_experts}) on rank {rank}")
    raise RingInputError(
        f"ring_moe: another rank of the EP group (rank {bad_ranks[0]}) passed expert ids outside [0, {num_experts}); "
        f"rank {rank} stops with it so no rank waits on a transfer"
    )

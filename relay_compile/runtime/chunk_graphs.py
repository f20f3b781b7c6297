"""chunk_graphs: a hop's chunk computed at a static shape, as a CUDA graph captured once and replayed per hop.

Why: at EP=64 a hop is about 8k rows on two experts; its GPU work is ~0.4 ms, and its host work (forward about
twenty aten dispatches and launches, backward forty, each 5-50 us) is more, so the ring is host-bound and its time
follows the host's speed (docs/BENCHMARKS.md, "EP=64"). A replayed graph is one launch for all of it.

What makes a chunk's shape static:

- **Equal groups.** A chunk of G experts with ``rows_G`` rows runs as G groups of ``C`` rows: ``C`` is the
  largest group's rows rounded up to a bucket (``bucket_rows``: 1/16 to 1/32 steps, so a few shapes recur across
  hops and steps). Padding rows read token 0 with score 0: they add exact zeros to ``y``/``dx`` and to the weight
  gradients (their score-scaled rows are zero), and their score gradients go to a slot that is dropped. A chunk
  whose padding would exceed 1/``PAD_LIMIT`` of its rows (skewed routing) runs as before. Equal groups are also
  batched GEMMs (``experts.uniform_rows``).
- **Static buffers.** A graph reads and writes only an *arena*, buffers shared by every shape of one layout:
  inputs (the gathered ``x`` rows, and ``dy`` rows and scores, the G experts' weights) and outputs (the output
  or ``dx`` rows, the score gradients, the weight gradients). Outside the graph, per hop, the rows are gathered
  into it and the weights copied (one op each), and the outputs are scattered into ``y``/``dx``, written at the
  pairs' positions and added into the weight-gradient sums. So a graph depends on no step's tensors and is kept
  across steps, and across MoE layers of the same shapes (``MAX_PROGRAMS`` shapes, least recently used go).

A shape's first chunk runs its body eagerly (warming up Triton and cuBLAS), then the body is captured on a side
stream into the arena's memory pool, where its intermediates live: every graph of the arena shares it, as they
replay one after another on one stream and keep nothing in it (their outputs are the arena's). Off CUDA, or
where ``capture`` is off, the same static-shape program runs eagerly: CPU tests run the whole path but the
capture.

Cost and memory: the graph path adds GPU work per hop (the weight copies, the output rows copied out, the weight
gradients added into the travelling sums instead of accumulated there by the GEMMs); a ring that waits for the
GPU is a few percent slower with it, a ring that waits for the host is as fast as its GPU work
(docs/BENCHMARKS.md, "Chunk graphs"). What the cache holds between steps, about one chunk's working set per
layout (the arena and its pool), is ``held_bytes()``; the benchmarks add it to the ring's peak. ``clear()``
drops it.

Legend: P sorted pairs of a step, Q padded rows of a step, G experts of a chunk, C rows per group, H hidden.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from relay_compile.experts import GroupedExperts
from relay_compile.routing import Chunk

log = logging.getLogger(__name__)

# A chunk runs padded when its padding rows are at most 1/PAD_LIMIT of its rows.
PAD_LIMIT = 8
# Shape programs kept (each a captured graph); the least recently used is dropped beyond this.
MAX_PROGRAMS = 16


def bucket_rows(rows: int) -> int:
    """``rows`` rounded up to a multiple of a power of two between 1/32 and 1/16 of it (at least 1)."""
    unit = 1 << max(0, rows.bit_length() - 5)
    return -(-rows // unit) * unit


def padded_rows(rows_G: Sequence[int]) -> int:
    """The rows per group ``C`` a chunk with ``rows_G`` runs padded to, or 0 where padding would cost more than
    1/``PAD_LIMIT`` of its rows."""
    total = sum(rows_G)
    if total == 0:
        return 0
    rows = bucket_rows(max(rows_G))
    return rows if (len(rows_G) * rows - total) * PAD_LIMIT <= total else 0


@dataclass(frozen=True, kw_only=True)
class PaddedChunk:
    """Where one chunk's padded rows sit in the step's tables: ``[start, start + groups * rows)``."""

    groups: int
    rows: int
    start: int

    @property
    def end(self) -> int:
        return self.start + self.groups * self.rows


class PaddedChunks:
    """A step's chunks that run padded, and the step's padded tables.

    ``tok_Q``/``score_Q``: each padded row's token and score (padding: token 0, score 0); ``pos_Q``: its
    sorted-pair position (padding: ``P``, one slot past the step's pairs, whose score gradient is dropped).
    Built on the device from the host counts in a few ops per step, no sync.
    """

    def __init__(self, chunks: dict[int, PaddedChunk], tok_Q: Tensor, score_Q: Tensor, pos_Q: Tensor) -> None:
        self._chunks, self.tok_Q, self.score_Q, self.pos_Q = chunks, tok_Q, score_Q, pos_Q

    def of(self, chunk: Chunk) -> PaddedChunk | None:
        return self._chunks.get(id(chunk))

    @classmethod
    def plan(cls, hops: Sequence[Sequence[Chunk]], tokens_P: Tensor, scores_S: Tensor) -> PaddedChunks | None:
        """The padded layout of every chunk that pads within ``PAD_LIMIT``; None if none does."""
        chunks: dict[int, PaddedChunk] = {}
        seg_start, seg_rows, seg_pad = [], [], []  # per (chunk, expert): first sorted pair, rows, padded rows
        total = 0
        for hop in hops:
            for chunk in hop:
                rows = padded_rows(chunk.rows)
                if not rows:
                    continue
                chunks[id(chunk)] = PaddedChunk(groups=len(chunk.rows), rows=rows, start=total)
                total += len(chunk.rows) * rows
                first = chunk.start
                for n in chunk.rows:
                    seg_start.append(first)
                    seg_rows.append(n)
                    seg_pad.append(rows)
                    first += n
        if not chunks:
            return None
        device, pairs = tokens_P.device, tokens_P.shape[0]
        segs = torch.tensor([seg_start, seg_rows, seg_pad], dtype=torch.int64,
                            pin_memory=device.type == "cuda").to(device, non_blocking=True)
        first_S, rows_S, pad_S = segs.unbind(0)
        seg_Q = torch.repeat_interleave(torch.arange(len(seg_pad), device=device), pad_S, output_size=total)
        base_S = torch.cumsum(pad_S, 0) - pad_S
        local_Q = torch.arange(total, device=device) - base_S[seg_Q]
        pos_Q = torch.where(local_Q < rows_S[seg_Q], first_S[seg_Q] + local_Q, pairs)
        tok_Q = torch.cat([tokens_P, tokens_P.new_zeros(1)])[pos_Q]
        score_Q = torch.cat([scores_S, scores_S.new_zeros(1)])[pos_Q]
        return cls(chunks, tok_Q, score_Q, pos_Q)


# --- shape programs ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """What an arena's buffers are shaped by: the rows' width and dtype, the scores' dtype, the packed weights'
    per-expert shapes and dtypes, and the device."""

    hidden: int
    dtype: torch.dtype
    score_dtype: torch.dtype
    weights: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    device: torch.device


class _Arena:
    """The static buffers of one layout's programs (each program views their prefixes), and the memory pool
    their graphs capture into. Grown (and its programs dropped) when a chunk needs more rows or experts."""

    def __init__(self, layout: _Layout, rows: int, groups: int) -> None:
        self.layout, self.rows, self.groups = layout, rows, groups
        dev = layout.device
        self.x_QH = torch.empty((rows, layout.hidden), dtype=layout.dtype, device=dev)
        self.out_QH = torch.empty((rows, layout.hidden), dtype=layout.dtype, device=dev)
        self.weights = [torch.empty((groups, *shape), dtype=dtype, device=dev) for shape, dtype in layout.weights]
        # Backward only, made at its first program: dy rows, scores, score gradients, weight gradients by dtype.
        self.dy_QH: Tensor | None = None
        self.score_Q: Tensor | None = None
        self.ds_Q: Tensor | None = None
        self.dws: dict[torch.dtype, list[Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if dev.type == "cuda" else None
        self.pool_bytes = 0

    def backward_buffers(self, grad_dtype: torch.dtype) -> list[Tensor]:
        """Make the backward's buffers (once); its weight gradients in ``grad_dtype``."""
        if self.dy_QH is None:
            self.dy_QH = torch.empty_like(self.x_QH)
            self.score_Q = torch.empty(self.rows, dtype=self.layout.score_dtype, device=self.x_QH.device)
            self.ds_Q = torch.empty(self.rows, dtype=torch.float32, device=self.x_QH.device)
        if grad_dtype not in self.dws:
            self.dws[grad_dtype] = [torch.empty_like(w, dtype=grad_dtype) for w in self.weights]
        return self.dws[grad_dtype]

    def fits(self, rows: int, groups: int) -> bool:
        return rows <= self.rows and groups <= self.groups

    def nbytes(self) -> int:
        bufs = [self.x_QH, self.out_QH, *self.weights, *(t for ts in self.dws.values() for t in ts)]
        bufs += [t for t in (self.dy_QH, self.score_Q, self.ds_Q) if t is not None]
        return sum(t.numel() * t.element_size() for t in bufs) + self.pool_bytes


Body = Callable[["_Program"], None]


class _Program:
    """One pass's chunk body at one shape (G groups of C rows): reads and writes its arena's prefixes. Run
    eagerly once, then (``capture``) captured, and replayed from then on."""

    def __init__(
        self, arena: _Arena, groups: int, rows: int, body: Body, owner: object, capture: bool,
        grad_dtype: torch.dtype | None = None,
    ) -> None:
        self.arena, self.groups, self.rows, self.body, self.capture = arena, groups, rows, body, capture
        self.owner = owner  # what the body calls: keeps its ``id`` in the program's key valid
        n = groups * rows
        self.x_QH, self.out_QH = arena.x_QH[:n], arena.out_QH[:n]
        self.weights = [w[:groups] for w in arena.weights]
        self.dws: list[Tensor] = []
        if grad_dtype is not None:
            self.dws = [g[:groups] for g in arena.backward_buffers(grad_dtype)]
            assert arena.dy_QH is not None and arena.score_Q is not None and arena.ds_Q is not None
            self.dy_QH, self.score_Q, self.ds_Q = arena.dy_QH[:n], arena.score_Q[:n], arena.ds_Q[:n]
        dev = arena.layout.device
        self.offsets_G = torch.arange(1, groups + 1, dtype=torch.int32, device=dev) * rows
        self.rows_G = (rows,) * groups
        self.graph: torch.cuda.CUDAGraph | None = None

    def run(self) -> None:
        """The body on what is now in the buffers: replayed where captured, else run (and then captured)."""
        _CACHE.runs += 1
        if self.graph is not None:
            self.graph.replay()
            return
        self.body(self)
        if self.capture:
            self._capture()

    def _capture(self) -> None:
        # On a side stream (capture needs a non-default one), ordered after the work queued so far; the eager
        # run above warmed up what initializes lazily. (torch.cuda.graph would also synchronize the device,
        # collect garbage and empty the allocator's cache at every capture.)
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        before = torch.cuda.memory_reserved()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(pool=self.arena.pool, capture_error_mode="thread_local")
                try:
                    self.body(self)
                finally:
                    graph.capture_end()
        except RuntimeError as e:  # an op that cannot be captured: this shape stays eager
            log.warning("chunk_graphs: capturing a %d x %d chunk failed, it runs eagerly: %s", self.groups,
                        self.rows, e)
            self.capture = False
            return
        finally:
            current.wait_stream(side)
            self.arena.pool_bytes += max(0, torch.cuda.memory_reserved() - before)
        self.graph = graph
        log.debug("chunk_graphs: captured a %d x %d chunk program", self.groups, self.rows)


class _Cache:
    """The process's arenas and shape programs (least recently used dropped beyond ``MAX_PROGRAMS``)."""

    def __init__(self) -> None:
        self.arenas: dict[_Layout, _Arena] = {}
        self.programs: collections.OrderedDict[tuple, _Program] = collections.OrderedDict()
        self.runs = 0  # program runs so far (the benchmarks tell which rows used the cache)

    def program(
        self, key: tuple, layout: _Layout, groups: int, rows: int, body: Body, owner: object, capture: bool,
        grad_dtype: torch.dtype | None = None,
    ) -> _Program:
        prog = self.programs.get(key)
        if prog is not None:
            self.programs.move_to_end(key)
            return prog
        arena = self.arenas.get(layout)
        if arena is None or not arena.fits(groups * rows, groups):
            if arena is not None:  # grown: its programs read the old buffers
                self.programs = collections.OrderedDict(
                    (k, p) for k, p in self.programs.items() if p.arena is not arena)
            # Room for 1/8 more rows than asked, so that nearby shapes fit without growing again.
            arena = _Arena(layout, max(groups * rows * 9 // 8, arena.rows if arena else 0),
                           max(groups, arena.groups if arena else 0))
            self.arenas[layout] = arena
        prog = self.programs[key] = _Program(arena, groups, rows, body, owner, capture, grad_dtype)
        while len(self.programs) > MAX_PROGRAMS:
            self.programs.popitem(last=False)
        return prog


_CACHE = _Cache()


def held_bytes() -> int:
    """Device memory the chunk programs hold between steps: arenas and their graphs' pools."""
    return sum(a.nbytes() for a in _CACHE.arenas.values())


def pool_bytes() -> int:
    """The part of ``held_bytes`` in graph pools (memory the caching allocator counts as free, not allocated)."""
    return sum(a.pool_bytes for a in _CACHE.arenas.values())


def runs() -> int:
    """How many chunk programs ran in this process so far."""
    return _CACHE.runs


def clear() -> None:
    """Drop every chunk program and arena (their memory returns to the allocator)."""
    _CACHE.programs.clear()
    _CACHE.arenas.clear()


def _layout(x_TH: Tensor, score: Tensor, weights: Sequence[Tensor]) -> _Layout:
    return _Layout(hidden=x_TH.shape[1], dtype=x_TH.dtype, score_dtype=score.dtype,
                   weights=tuple((tuple(w.shape[1:]), w.dtype) for w in weights), device=x_TH.device)


def _fill(prog: _Program, x_TH: Tensor, tok_C: Tensor, weights: Sequence[Tensor]) -> None:
    """The chunk's rows and weights into the program's buffers (one op each)."""
    torch.index_select(x_TH, 0, tok_C, out=prog.x_QH)
    for static, w in zip(prog.weights, weights, strict=True):
        static.copy_(w)


def forward(
    fn: GroupedExperts, padded: PaddedChunks, pc: PaddedChunk, x_TH: Tensor, weights: Sequence[Tensor],
    add_rows: Callable[[Tensor, Tensor, Tensor], None], capture: bool,
) -> None:
    """One padded chunk's forward: ``add_rows(tok, F(x[tok]), score)`` (the caller's scaled scatter into ``y``)."""
    tok_C, score_C = padded.tok_Q[pc.start : pc.end], padded.score_Q[pc.start : pc.end]
    layout = _layout(x_TH, score_C, weights)

    def body(p: _Program) -> None:
        p.out_QH.copy_(fn.forward_rows(p.x_QH, p.offsets_G, p.rows_G, p.weights))

    prog = _CACHE.program(("forward", id(fn), layout, pc.groups, pc.rows), layout, pc.groups, pc.rows, body, fn,
                          capture)
    _fill(prog, x_TH, tok_C, weights)
    prog.run()
    add_rows(tok_C, prog.out_QH, score_C[:, None])


def _zeroed(grads: list[Tensor]) -> list[Tensor]:
    for g in grads:
        g.zero_()
    return grads


def backward(
    fn: GroupedExperts, padded: PaddedChunks, pc: PaddedChunk, x_TH: Tensor, weights: Sequence[Tensor],
    dy_TH: Tensor, grad_dtype: torch.dtype, capture: bool,
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """One padded chunk's fused backward (``GroupedExperts.vjp_rows`` on the gathered rows).

    Returns ``(tok, dx rows, d_score rows, weight gradients in grad_dtype)``, all but ``tok`` the arena's
    buffers: the caller scatters ``dx``, writes the score gradients at ``padded.pos_Q[pc.start:pc.end]`` and
    adds the weight gradients (copying what it keeps: the next chunk overwrites them).
    """
    tok_C, score_C = padded.tok_Q[pc.start : pc.end], padded.score_Q[pc.start : pc.end]
    layout = _layout(x_TH, score_C, weights)

    def body(p: _Program) -> None:
        # The weight-gradient GEMMs accumulate into the arena's buffers, zeroed right before them.
        dx_CH, _, _ = fn.vjp_rows(p.x_QH, None, p.offsets_G, p.rows_G, p.weights, p.dy_QH, p.score_Q,
                                  grad_dtype=grad_dtype, grad_into=lambda: _zeroed(p.dws), d_score_out=p.ds_Q)
        p.out_QH.copy_(dx_CH)

    prog = _CACHE.program(("backward", id(fn), layout, pc.groups, pc.rows, grad_dtype), layout, pc.groups,
                          pc.rows, body, fn, capture, grad_dtype)
    _fill(prog, x_TH, tok_C, weights)
    torch.index_select(dy_TH, 0, tok_C, out=prog.dy_QH)
    prog.score_Q.copy_(score_C)
    prog.run()
    return tok_C, prog.out_QH, prog.ds_Q, prog.dws

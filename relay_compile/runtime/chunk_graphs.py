"""chunk_graphs: a hop's chunk computed at a static shape, as a CUDA graph captured once and replayed per hop.

Why: at EP=64 a hop is about 8k rows on two experts; its GPU work is ~0.4 ms, and its host work (forward about
twenty aten dispatches and launches, backward forty, each 5-50 us) is more, so the ring is host-bound and its time
follows the host's speed (docs/BENCHMARKS.md, "EP=64"). A replayed graph is one launch for all of it.

What makes a chunk's shape static:

- **Padded rows.** A chunk of ``n`` rows (sorted by expert, G experts) runs as ``C`` rows, ``n`` rounded up to a
  bucket (``bucket_rows``: steps of 1/16 to 1/32, so a few shapes recur across hops and steps). The grouped GEMMs
  take the experts' offsets from a device buffer, with the last expert's group extended over the padding
  rows; those read token 0 with score 0, so they add exact zeros to ``y``/``dx`` and to the weight gradients
  (their score-scaled rows are zero), and their score gradients are dropped.
- **Static buffers.** A graph reads and writes only an *arena*, buffers shared by every shape of one layout:
  inputs (the gathered ``x`` rows, and ``dy`` rows and scores, the experts' offsets and weights) and outputs
  (the output or ``dx`` rows, the score gradients, the weight gradients). Outside the graph, per hop, the rows
  are gathered into it and the offsets and weights copied (one op each), and the outputs are scattered into
  ``y``/``dx``, copied into the pairs' score gradients and added into the weight-gradient sums. So a graph
  depends on no step's tensors and is kept across steps, and across MoE layers of the same shapes
  (``MAX_PROGRAMS`` shapes, least recently used go; about 20 at EP=64 and 40 at EP=8 under the Qwen3 router).

A shape's first chunk runs its body eagerly (warming up Triton and cuBLAS), then the body is captured on the
arena's stream into the arena's memory pool, where its intermediates live: every graph of the arena shares it,
as they replay one after another on one stream and keep nothing in it (their outputs are the arena's). Off CUDA,
or where a capture failed, the same static-shape program runs eagerly: CPU tests run the whole path but the
capture.

Numerics: a chunk's weight gradients come from ``torch._grouped_mm`` (fp32 accumulation, bf16 output for bf16
weights: rounded once per chunk) and are added into the ring's sums, which stay fp32 (``fp32_accumulation``).

Cost (H200, Qwen3 layer, docs/BENCHMARKS.md "Chunk graphs"): at EP=64 the host time per step drops by a quarter
to a third, but the path adds GPU work (the weight copies, the output rows copied out, bf16 weight-gradient
partials added into the sums instead of fp32 GEMMs into them, the padding rows: 12-14 ms a step), and the cache
holds about one chunk's working set per layout between steps (the arena and its pool, ``held_bytes()``; the
benchmarks add it to the ring's peak; ``clear()`` drops it). Hence opt-in (``RingOptions.chunk_graphs``).

Legend: P sorted pairs of a step, Q padded rows of a step, G experts of a chunk, S padded rows of a chunk,
H hidden.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from relay_compile.experts import GroupedExperts
from relay_compile.routing import Chunk, padded_positions

log = logging.getLogger(__name__)

# Shape programs kept (each a captured graph); the least recently used is dropped beyond this. Fewer than a
# step uses recapture every step (16 did at EP=8 and EP=64: docs/bench/h200-chunk-graphs/raw-4).
MAX_PROGRAMS = 64


def bucket_rows(rows: int) -> int:
    """``rows`` rounded up to a multiple of a power of two between 1/32 and 1/16 of it (at least 1)."""
    unit = 1 << max(0, rows.bit_length() - 5)
    return -(-rows // unit) * unit


@dataclass(frozen=True, kw_only=True)
class PaddedChunk:
    """One chunk's place in the step's padded tables: its ``rows`` padded rows from ``start`` (the first ``real``
    are its sorted pairs ``[first, first + real)``), its G experts' offsets from ``offsets_at``."""

    groups: int
    rows: int
    start: int
    first: int
    real: int
    offsets_at: int

    @property
    def end(self) -> int:
        return self.start + self.rows


class PaddedChunks:
    """A step's chunks padded to bucketed row counts, and the step's padded tables.

    ``tok_Q``/``score_Q``: each padded row's token and score (padding rows: token 0, score 0); ``offsets``: each
    chunk's grouped-GEMM offsets (int32, the last one its padded row count). Built on the device from the host
    counts in a few ops per step, no sync.
    """

    def __init__(self, chunks: dict[int, PaddedChunk], tok_Q: Tensor, score_Q: Tensor, offsets: Tensor) -> None:
        self._chunks, self.tok_Q, self.score_Q, self.offsets = chunks, tok_Q, score_Q, offsets

    def of(self, chunk: Chunk) -> PaddedChunk | None:
        return self._chunks.get(id(chunk))

    @classmethod
    def plan(cls, hops: Sequence[Sequence[Chunk]], tokens_P: Tensor, scores_S: Tensor) -> PaddedChunks | None:
        """The padded layout of every chunk with rows; None if there is none."""
        chunks: dict[int, PaddedChunk] = {}
        seg_first: list[int] = []
        seg_real: list[int] = []
        seg_rows: list[int] = []
        offsets: list[int] = []  # per chunk its G grouped-GEMM offsets
        total = 0
        for hop in hops:
            for chunk in hop:
                real = chunk.end - chunk.start
                if not real:
                    continue
                rows = bucket_rows(real)
                chunks[id(chunk)] = PaddedChunk(groups=len(chunk.rows), rows=rows, start=total, first=chunk.start,
                                                real=real, offsets_at=len(offsets))
                seg_first.append(chunk.start)
                seg_real.append(real)
                seg_rows.append(rows)
                acc = 0
                for n in chunk.rows[:-1]:
                    acc += n
                    offsets.append(acc)
                offsets.append(rows)  # the last expert's group takes the padding rows
                total += rows
        if not chunks:
            return None
        device = tokens_P.device
        offsets_dev = torch.tensor(offsets, dtype=torch.int32, pin_memory=device.type == "cuda").to(
            device, non_blocking=True)
        pos_Q = padded_positions(seg_first, seg_real, seg_rows, tokens_P.shape[0], device)
        tok_Q = torch.cat([tokens_P, tokens_P.new_zeros(1)])[pos_Q]
        score_Q = torch.cat([scores_S, scores_S.new_zeros(1)])[pos_Q]
        return cls(chunks, tok_Q, score_Q, offsets_dev)


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
    and stream their graphs capture in. Grown (and its programs dropped) when a chunk needs more rows or
    experts."""

    def __init__(self, layout: _Layout, rows: int, groups: int) -> None:
        self.layout, self.rows, self.groups = layout, rows, groups
        dev = layout.device
        self.x_QH = torch.empty((rows, layout.hidden), dtype=layout.dtype, device=dev)
        self.out_QH = torch.empty((rows, layout.hidden), dtype=layout.dtype, device=dev)
        self.offsets_G = torch.empty(groups, dtype=torch.int32, device=dev)
        self.weights = [torch.empty((groups, *shape), dtype=dtype, device=dev) for shape, dtype in layout.weights]
        # Backward only, made at its first program: dy rows, scores, score gradients, weight gradients.
        self.dy_QH: Tensor | None = None
        self.score_Q: Tensor | None = None
        self.ds_Q: Tensor | None = None
        self.dws: list[Tensor] = []
        cuda = dev.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if cuda else None
        # One capture stream: the allocator reuses a pool's freed blocks only for the stream that freed them, so
        # every capture of the arena on the same stream shares one working set.
        self.stream = torch.cuda.Stream(dev) if cuda else None
        self.pool_bytes = 0

    def make_backward_buffers(self) -> None:
        if self.dy_QH is None:
            self.dy_QH = torch.empty_like(self.x_QH)
            self.score_Q = torch.empty(self.rows, dtype=self.layout.score_dtype, device=self.x_QH.device)
            self.ds_Q = torch.empty(self.rows, dtype=torch.float32, device=self.x_QH.device)
            self.dws = [torch.empty_like(w) for w in self.weights]

    def fits(self, rows: int, groups: int) -> bool:
        return rows <= self.rows and groups <= self.groups

    def nbytes(self) -> int:
        bufs = [self.x_QH, self.out_QH, self.offsets_G, *self.weights, *self.dws]
        bufs += [t for t in (self.dy_QH, self.score_Q, self.ds_Q) if t is not None]
        return sum(t.numel() * t.element_size() for t in bufs) + self.pool_bytes


Body = Callable[["_Program"], None]


class _Program:
    """One pass's chunk body at one shape (S rows on G experts): reads and writes its arena's prefixes. Run
    eagerly once, then (on CUDA) captured, and replayed from then on."""

    def __init__(self, arena: _Arena, groups: int, rows: int, body: Body, owner: object, backward: bool) -> None:
        self.arena, self.groups, self.rows, self.body = arena, groups, rows, body
        # Captured where the arena has a graph pool (CUDA); off CUDA the body runs eagerly every time.
        self.capture = arena.pool is not None
        self.owner = owner  # what the body calls: keeps its ``id`` in the program's key valid
        self.x_QH, self.out_QH, self.offsets_G = arena.x_QH[:rows], arena.out_QH[:rows], arena.offsets_G[:groups]
        self.weights = [w[:groups] for w in arena.weights]
        self.dws: list[Tensor] = []
        if backward:
            arena.make_backward_buffers()
            assert arena.dy_QH is not None and arena.score_Q is not None and arena.ds_Q is not None
            self.dy_QH, self.score_Q, self.ds_Q = arena.dy_QH[:rows], arena.score_Q[:rows], arena.ds_Q[:rows]
            self.dws = [g[:groups] for g in arena.dws]
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
        # On the arena's stream (capture needs a non-default one), ordered after the work queued so far; the
        # eager run above warmed up what initializes lazily. (torch.cuda.graph would also synchronize the
        # device, collect garbage and empty the allocator's cache at every capture.)
        current, side = torch.cuda.current_stream(), self.arena.stream
        assert side is not None
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
            log.warning("chunk_graphs: capturing a %d-row chunk on %d experts failed, it runs eagerly: %s",
                        self.rows, self.groups, e)
            self.capture = False
            return
        finally:
            current.wait_stream(side)
            self.arena.pool_bytes += max(0, torch.cuda.memory_reserved() - before)
        self.graph = graph
        log.debug("chunk_graphs: captured a %d-row chunk program on %d experts", self.rows, self.groups)


class _Cache:
    """The process's arenas and shape programs (least recently used dropped beyond ``MAX_PROGRAMS``)."""

    def __init__(self) -> None:
        self.arenas: dict[_Layout, _Arena] = {}
        self.programs: collections.OrderedDict[tuple, _Program] = collections.OrderedDict()
        self.runs = 0  # program runs so far (the benchmarks tell which rows used the cache)

    def program(
        self, key: tuple, layout: _Layout, groups: int, rows: int, body: Body, owner: object, backward: bool = False,
    ) -> _Program:
        prog = self.programs.get(key)
        if prog is not None:
            self.programs.move_to_end(key)
            return prog
        arena = self.arenas.get(layout)
        if arena is None or not arena.fits(rows, groups):
            if arena is not None:  # grown: its programs read the old buffers
                self.programs = collections.OrderedDict(
                    (k, p) for k, p in self.programs.items() if p.arena is not arena)
            # Room for 1/8 more rows than asked, so that nearby shapes fit without growing again.
            arena = _Arena(layout, max(rows * 9 // 8, arena.rows if arena else 0),
                           max(groups, arena.groups if arena else 0))
            self.arenas[layout] = arena
        prog = self.programs[key] = _Program(arena, groups, rows, body, owner, backward)
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


def _fill(prog: _Program, padded: PaddedChunks, pc: PaddedChunk, x_TH: Tensor, weights: Sequence[Tensor]) -> Tensor:
    """The chunk's rows, offsets and weights into the program's buffers (one op each); the rows' tokens."""
    tok_S = padded.tok_Q[pc.start : pc.end]
    torch.index_select(x_TH, 0, tok_S, out=prog.x_QH)
    prog.offsets_G.copy_(padded.offsets[pc.offsets_at : pc.offsets_at + pc.groups])
    for static, w in zip(prog.weights, weights, strict=True):
        static.copy_(w)
    return tok_S


# The grouping is the device offsets alone (no host row counts): the program holds for any rows per expert.
_NO_HOST_ROWS: tuple[int, ...] = ()


def forward(
    fn: GroupedExperts, padded: PaddedChunks, pc: PaddedChunk, x_TH: Tensor, weights: Sequence[Tensor],
    add_rows: Callable[[Tensor, Tensor, Tensor], None],
) -> None:
    """One padded chunk's forward: ``add_rows(tok, F(x[tok]), score)`` (the caller's scaled scatter into ``y``)."""
    score_S = padded.score_Q[pc.start : pc.end]
    layout = _layout(x_TH, score_S, weights)

    def body(p: _Program) -> None:
        p.out_QH.copy_(fn.forward_rows(p.x_QH, p.offsets_G, _NO_HOST_ROWS, p.weights))

    prog = _CACHE.program(("forward", id(fn), layout, pc.groups, pc.rows), layout, pc.groups, pc.rows, body, fn)
    tok_S = _fill(prog, padded, pc, x_TH, weights)
    prog.run()
    add_rows(tok_S, prog.out_QH, score_S[:, None])


def backward(
    fn: GroupedExperts, padded: PaddedChunks, pc: PaddedChunk, x_TH: Tensor, weights: Sequence[Tensor],
    dy_TH: Tensor,
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """One padded chunk's fused backward (``GroupedExperts.vjp_rows`` on the gathered rows).

    Returns ``(tok, dx rows, d_score rows, weight gradients)``, all but ``tok`` the arena's buffers (valid until
    the next chunk): the caller scatters ``dx``, keeps the first ``pc.real`` score gradients (those of the sorted
    pairs ``[pc.first, pc.first + pc.real)``) and adds the weight gradients, in the weights' dtype, into its sums.
    """
    score_S = padded.score_Q[pc.start : pc.end]
    layout = _layout(x_TH, score_S, weights)

    def body(p: _Program) -> None:
        dx_SH, _, dws = fn.vjp_rows(p.x_QH, None, p.offsets_G, _NO_HOST_ROWS, p.weights, p.dy_QH, p.score_Q,
                                    d_score_out=p.ds_Q)
        p.out_QH.copy_(dx_SH)
        for static, g in zip(p.dws, dws, strict=True):
            static.copy_(g)

    prog = _CACHE.program(("backward", id(fn), layout, pc.groups, pc.rows), layout, pc.groups, pc.rows, body, fn,
                          backward=True)
    tok_S = _fill(prog, padded, pc, x_TH, weights)
    torch.index_select(dy_TH, 0, tok_S, out=prog.dy_QH)
    prog.score_Q.copy_(score_S)
    prog.run()
    return tok_S, prog.out_QH, prog.ds_Q, prog.dws

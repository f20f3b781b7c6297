"""``RingOptions``: the options of one ring, validated once, with the one key every rank derives from them.

The functional API (``ring_moe``), the backend's options (``relay_compile.options``) and the rewrite pass all
build a ``RingOptions``; nothing else validates ``routing`` or ``max_hop_rows``. ``key()`` is part of the
ring's spec key (``runtime.specs``), a key of this process's registry. ``routing``, ``overlap``, ``remat``,
``fp32_accumulation`` and ``fp8`` change what travels and when, and ``ring`` what the cost model decides, so every
rank must pass the same ones: ``runtime.agreement`` checks them at every call (``link_gbps``: the slowest
counts). ``max_hop_rows`` changes only how a rank cuts its own hops: it may differ across ranks and calls.

"No bound" on hop rows is ``None`` here; the process-wide config spells it ``0`` (config entries cannot be
None) and ``relay_compile.options`` converts it. The default, ``"auto"``, is a bound derived from each call's
token count (``hop_row_bound``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from relay_compile.routing import ROUTINGS

# The ``max_hop_rows`` option: rows a hop computes at most (None: a whole hop; "auto": the shape-derived bound).
MaxHopRows = int | None | Literal["auto"]
# Whether a block runs as a ring (``runtime.cost_model.choose``): "auto" where it is predicted no slower than
# the all-to-all, "memory" also where it is slower but saves memory, "always", or "never" (the block's
# all-to-all, ``runtime.all_to_all``: for comparisons and tests).
RINGS: tuple[str, ...] = ("auto", "memory", "always", "never")
ChunkGraphs = bool | Literal["auto"]
# The ``link_gbps`` option: GB/s of the slowest link a hop's transfer crosses, or "auto" (``transport.link_gbps``).
LinkGbps = float | Literal["auto"]
# The ``save_projections`` option: the expert ring's forward keeps every pair's first projection for its backward
# (True), never (False), or where the cost model grants it ("auto", ``cost_model.choose``).
SaveProjections = bool | Literal["auto"]
# ``max_hop_rows="auto"``: a chunk holds at most 1/AUTO_HOP_ROWS_FRACTION of the rank's tokens (its gathered
# rows, their gradients and the expert activations then stay below the token-sized sums the step holds
# anyway), and never fewer than AUTO_MIN_HOP_ROWS rows: each chunk costs a fixed host time, which below that
# size outweighs the memory it saves (docs/BENCHMARKS.md, "Bounded hops by default").
AUTO_HOP_ROWS_FRACTION = 4
AUTO_MIN_HOP_ROWS = 16384
# A forward chunk under ``"auto"`` may hold this many times a backward chunk's rows: a forward row keeps its
# gathered row, the expert's input projections, activation and output alive (2H + 3F values for SwiGLU), a
# backward row also the output gradient, the input gradient and the projections' gradients (3H + 5F), and the
# forward runs before the backward's gradient sums exist, so twice the rows stay below the backward's peak.
AUTO_FORWARD_ROWS_FACTOR = 2


def hop_row_bound(max_hop_rows: MaxHopRows, tokens: int, *, forward: bool = False) -> int | None:
    """The rows of one expert call for a rank with ``tokens`` tokens (None: whole hops); ``forward``: in the
    forward ring (``"auto"`` allows it ``AUTO_FORWARD_ROWS_FACTOR`` times the rows; an explicit bound holds in
    both directions)."""
    if max_hop_rows == "auto":
        bound = max(tokens // AUTO_HOP_ROWS_FRACTION, AUTO_MIN_HOP_ROWS)
        return bound * AUTO_FORWARD_ROWS_FACTOR if forward else bound
    return max_hop_rows


@dataclass(frozen=True, kw_only=True)
class HopShape:
    """What ``owners_per_hop`` reads: sizes every rank of a ring shares (the agreed table's), so every rank
    builds the same program.

    ``row_bytes``: an estimate of a forward row's footprint through the experts, both widths of each stacked
    expert matrix (``(F + H)`` per matrix: the rows in and out of each GEMM) in the tokens' dtype, whatever the
    layout; ``partition_bytes``: one rank's expert weights as they circulate; ``token_bytes``: one token's row;
    ``elem_bytes``: the tokens' element size.
    """

    ranks: int
    max_tokens: int
    min_tokens: int
    top_k: int
    row_bytes: int
    partition_bytes: int
    token_bytes: int
    elem_bytes: int = 2

    @staticmethod
    def of(ranks: int, tokens_N: Sequence[int], top_k: int, weights: Sequence[tuple[Sequence[int], int]],
           hidden: int, elem_bytes: int) -> HopShape:
        """From every rank's token count and the circulating (packed) expert weights' ``(shape, bytes)``: their
        ``(E_l, out, in)`` matrices (biases and other tensors count in the partition only)."""
        matrices = [shape for shape, _ in weights if len(shape) == 3]
        return HopShape(
            ranks=ranks, max_tokens=max(tokens_N), min_tokens=min(tokens_N), top_k=top_k,
            row_bytes=sum(shape[1] + shape[2] for shape in matrices) * elem_bytes,
            partition_bytes=sum(nbytes for _, nbytes in weights), token_bytes=hidden * elem_bytes,
            elem_bytes=elem_bytes,
        )


def _hop_rows(shape: HopShape) -> int:
    """Rows a hop expects under balanced routing: ``R = max_tokens * top_k / N``."""
    return max(1, shape.max_tokens * shape.top_k // shape.ranks)


def _owners_budget(shape: HopShape) -> int:
    """What owners beyond the first may add: one top-k-expanded ``[T*K, H]`` buffer of ``min_tokens``."""
    return shape.min_tokens * shape.top_k * shape.token_bytes


def _forward_owner_bytes(shape: HopShape) -> int:
    """What one more owner in a forward hop holds: ``R`` rows and two partitions (the stack computed, the one
    arriving)."""
    return _hop_rows(shape) * shape.row_bytes + 2 * shape.partition_bytes


def _backward_owner_bytes(shape: HopShape) -> int:
    """What one more owner in a backward hop holds: ``R`` backward rows and six partitions' bytes (weights
    computed and arriving, their fp32 gradient sums summed and arriving)."""
    return _hop_rows(shape) * shape.row_bytes * AUTO_FORWARD_ROWS_FACTOR + 6 * shape.partition_bytes


# Bytes of one routed token's routing as token routing circulates it: its ``K`` int64 expert ids and ``K`` scores
# (counted at 4 bytes: an upper bound for bf16 scores, exact for fp32 ones).
_ROUTING_BYTES_PER_K = 8 + 4
# Bytes of one element of a sum token routing carries across hops (``y``, ``dx``): fp32, the default
# ``fp32_accumulation`` (an upper bound without it).
_SUM_ELEM_BYTES = 4


def _token_sum_bytes(shape: HopShape) -> int:
    """One token's row of a travelling sum (``y`` or ``dx``): the row in fp32."""
    return shape.token_bytes * _SUM_ELEM_BYTES // max(1, shape.elem_bytes)


def _forward_partition_bytes(shape: HopShape) -> int:
    """What one more source's tokens in a forward hop of token routing hold: its tokens and their routing in the
    stack computed and the one arriving, their ``y`` sums in the stack summed and the one arriving, and ``R``
    rows through the experts (``max_tokens``: the largest partition)."""
    tokens = shape.max_tokens * (shape.token_bytes + shape.top_k * _ROUTING_BYTES_PER_K)
    return 2 * tokens + 2 * shape.max_tokens * _token_sum_bytes(shape) + _hop_rows(shape) * shape.row_bytes


def _backward_partition_bytes(shape: HopShape) -> int:
    """``_forward_partition_bytes`` of a backward hop: ``dy`` travels beside ``x``, ``dx`` and ``d_scores`` sums
    trail them, and ``R`` backward rows (``AUTO_FORWARD_ROWS_FACTOR`` forward rows each)."""
    t = shape.max_tokens
    tokens = t * (2 * shape.token_bytes + shape.top_k * _ROUTING_BYTES_PER_K)
    sums = t * (_token_sum_bytes(shape) + shape.top_k * 4)
    return 2 * tokens + 2 * sums + _hop_rows(shape) * shape.row_bytes * AUTO_FORWARD_ROWS_FACTOR


def token_partitions_per_hop(shape: HopShape) -> int:
    """How many sources' tokens one forward hop of token routing holds (``programs.build``: the grouped rings).

    As ``owners_per_hop``: ``g`` partitions per hop run ``N / g`` hops instead of ``N`` (the first stack gathered
    at hop 0), with ``g R`` at most ``AUTO_MIN_HOP_ROWS`` rows, and what the ``g - 1`` more partitions hold stays
    within one top-k-expanded ``[T*K, H]`` buffer of ``min_tokens``. A partition is a whole rank's tokens, not a
    hop's rows, so far fewer fit than owners do: each more one holds its tokens and their fp32 ``y`` sums twice
    (computed and arriving), ``12 T H`` bytes in bf16 against the budget's ``2 K T H``.

    Qwen3 layer, bf16 (``K = 8``): 2 at EP=16 up to 16384 tokens per rank, EP=32 up to 32768, EP=64 up to 65536,
    else 1 (EP=8: 1); ``token_backward_partitions_per_hop``: 1 at every one of those (``dy`` and the ``dx`` sums
    too: one more source's bytes exceed the budget whatever the tokens).
    """
    g = 1
    while (_stackable(shape, 2 * g) and (2 * g - 1) * _forward_partition_bytes(shape) <= _owners_budget(shape)
           and 2 * g * _hop_rows(shape) <= AUTO_MIN_HOP_ROWS):
        g *= 2
    return g


def token_backward_partitions_per_hop(shape: HopShape) -> int:
    """``token_partitions_per_hop`` for a backward hop (``_backward_partition_bytes`` each partition beyond the
    first, at most ``AUTO_MIN_HOP_ROWS / AUTO_FORWARD_ROWS_FACTOR`` rows a hop, as ``backward_owners_per_hop``)."""
    g = 1
    while (_stackable(shape, 2 * g) and (2 * g - 1) * _backward_partition_bytes(shape) <= _owners_budget(shape)
           and 2 * g * _hop_rows(shape) <= AUTO_MIN_HOP_ROWS // AUTO_FORWARD_ROWS_FACTOR):
        g *= 2
    return g


def stack_extra_bytes(shape: HopShape, routing: str, forward: int, backward: int) -> tuple[int, int]:
    """Bytes a ring of ``forward`` / ``backward`` partitions per hop (expert routing's owners, token routing's
    sources) holds beyond one per hop in each direction, by the rules' estimates (the forward's stacks are gone
    when the backward's arrive)."""
    if routing == "token":
        return (forward - 1) * _forward_partition_bytes(shape), (backward - 1) * _backward_partition_bytes(shape)
    return (forward - 1) * _forward_owner_bytes(shape), (backward - 1) * _backward_owner_bytes(shape)


def owners_per_hop(shape: HopShape) -> int:
    """How many owners' weights one forward hop of expert routing holds (``programs.build``: the grouped forward).

    Time: a hop's fixed host cost (transfer, planning, kernel launches: ~0.5 ms on the H200) outweighs its
    compute below ``AUTO_MIN_HOP_ROWS`` rows. A hop expects ``R = max_tokens * top_k / N`` rows under balanced
    routing; ``g`` owners per hop run ``N / g`` forward hops instead of ``N`` (and gather the first stack at
    hop 0), with ``g R`` at most ``AUTO_MIN_HOP_ROWS`` rows.

    Memory: each owner more in a hop holds ``R`` more rows and two more partitions (the stack computed, the one
    arriving). All of it together stays within one top-k-expanded ``[T*K, H]`` buffer of ``min_tokens`` (the
    all-to-all holds about six of them; the ring none), the budget the grouped backward has too
    (``backward_owners_per_hop``).

    ``g``: the largest power of two meeting both that divides ``N`` and is at most ``N / 2`` (1: the plain ring).
    Qwen3 layer, bf16, EP=64: 16384 tokens -> 8, 32768 -> 4, 65536 -> 2 (8192-row hops); EP=8 -> 1.
    """
    g = 1
    while forward_owners_fit(shape, 2 * g) and 2 * g * _hop_rows(shape) <= AUTO_MIN_HOP_ROWS:
        g *= 2
    return g


def backward_owners_per_hop(shape: HopShape) -> int:
    """How many owners' weights one backward hop of expert routing holds (``programs.build``: the grouped backward).

    Time: as ``owners_per_hop``, ``N / g`` backward hops instead of ``N`` where hops are small. A backward
    row holds about ``AUTO_FORWARD_ROWS_FACTOR`` times a forward row (the output and input gradients and the
    projections' gradients beside the recomputed activations), so a grouped backward hop holds at most
    ``AUTO_MIN_HOP_ROWS / AUTO_FORWARD_ROWS_FACTOR`` rows: hops that size or larger stay one owner, and so does
    their peak (Qwen3 layer: EP=64 from 65536 tokens per rank, EP=8 from 8192).

    Memory: each owner more holds ``R`` more backward rows and six more partitions' bytes: its weights in the
    stack computed and in the one arriving, and their weight-gradient sums (fp32: twice the bf16 bytes) in the
    stack summed and the one arriving. All of it together stays within one top-k-expanded ``[T*K, H]`` buffer
    of ``min_tokens`` (the all-to-all holds about six of them; the ring none).

    ``g``: the largest power of two meeting both that divides ``N`` and is at most ``N / 2`` (1: the plain ring).
    Qwen3 layer, bf16, EP=64: 16384 tokens -> 4, 32768 -> 2, 65536 -> 1; EP=8: 1 from 4096 tokens on.
    """
    g = 1
    while (backward_owners_fit(shape, 2 * g)
           and 2 * g * _hop_rows(shape) <= AUTO_MIN_HOP_ROWS // AUTO_FORWARD_ROWS_FACTOR):
        g *= 2
    return g


def _stackable(shape: HopShape, g: int) -> bool:
    """Whether a ring of ``shape.ranks`` can hold ``g`` owners per hop: ``N / g`` stacks of distinct owners."""
    n = shape.ranks
    return g == 1 or (1 < g <= n // 2 and n % g == 0)


def forward_owners_fit(shape: HopShape, g: int) -> bool:
    """Whether ``g`` owners per forward hop fit: the ring can stack them and their rows and partitions
    (``_forward_owner_bytes`` each beyond the first) stay within one top-k-expanded buffer of ``min_tokens``."""
    return _stackable(shape, g) and (g - 1) * _forward_owner_bytes(shape) <= _owners_budget(shape)


def backward_owners_fit(shape: HopShape, g: int) -> bool:
    """``forward_owners_fit`` for a backward hop (``_backward_owner_bytes`` each owner beyond the first)."""
    return _stackable(shape, g) and (g - 1) * _backward_owner_bytes(shape) <= _owners_budget(shape)


def larger_owners(shape: HopShape, least: tuple[int, int]) -> list[tuple[int, int]]:
    """Owners per forward and per backward hop beyond the rules' ``least`` that memory allows: every pair of
    powers of two, each at least ``least``'s and fitting (``forward_owners_fit``, ``backward_owners_fit``), but
    ``least`` itself.

    The rules stop a stack at ``AUTO_MIN_HOP_ROWS`` rows, where a hop's fixed cost is paid back; past that,
    more owners still cut hops (and their host time) for memory. The cost model takes one of these only where
    the rules' ring would lose to the all-to-all (``cost_model.choose``): it then holds more than the rules' ring
    and far less than the all-to-all (within one expanded buffer where the all-to-all holds about six).
    """
    def powers(least_g: int, fits: Callable[[HopShape, int], bool]) -> list[int]:
        out, g = [], least_g
        while fits(shape, g):
            out.append(g)
            g *= 2
        return out

    return [(f, b) for f in powers(least[0], forward_owners_fit) for b in powers(least[1], backward_owners_fit)
            if (f, b) != least]


class InvalidRingOption(ValueError):
    """An option value out of its domain; ``problem`` names the option and what is valid, ``argument`` the
    option (the name ``runtime.agreement`` reports to the other ranks)."""

    def __init__(self, problem: str, argument: str) -> None:
        super().__init__(problem)
        self.problem, self.argument = problem, argument


@dataclass(frozen=True, kw_only=True)
class RingOptions:
    """How a ring runs (all but ``max_hop_rows`` identical on every rank).

    - ``routing``: ``"expert"`` circulates weights, ``"token"`` circulates tokens, ``"auto"`` picks the one
      with less traffic per hop from the shapes of all ranks at the first call.
    - ``overlap``: post each hop's transfer before its compute (False: the sequential ring).
    - ``remat``: backward hops recompute and release their activations (False: replay the block first).
    - ``max_hop_rows``: rows of one expert call; hops with more pairs run in chunks (None: whole hops;
      ``"auto"``: ``hop_row_bound``, ``1 / AUTO_HOP_ROWS_FRACTION`` of the rank's tokens, at least
      ``AUTO_MIN_HOP_ROWS`` rows). A per-rank memory knob: nothing that travels depends on it.
    - ``chunk_graphs``: a hop's chunks run at bucketed row counts as CUDA graphs captured once and replayed
      (``runtime.chunk_graphs``): less host work per hop, for about one chunk's working set held between steps
      and a few percent more GPU work; ``"auto"``: on CUDA; True off CUDA runs the same static-shape path
      eagerly. Off by default: on the H200 it cut the host-bound EP=64 ring's time by a tenth and cost the peak
      a fifth (docs/BENCHMARKS.md, "Chunk graphs"). A per-rank knob like ``max_hop_rows``: nothing that
      travels depends on it.
    - ``ring``: ``"auto"`` runs the block as a ring where the cost model predicts it no slower than the
      all-to-all it would run instead (``runtime.cost_model.choose``, calibrated on CUDA; on other devices the
      ring always runs): a call, the op's own path (``kept="op"``); a compile-time keep, the traced one;
      ``"memory"`` also where it is slower but the all-to-all's predicted peak is higher; ``"always"``;
      ``"never"`` runs the block's all-to-all (``runtime.all_to_all``). Decided per call from the agreed
      shapes, the same on every rank.
    - ``fp32_accumulation``: what the ring sums across hops (weight gradients, and token routing's travelling
      outputs and input gradients) is summed and sent in fp32, as an fp32-accumulating GEMM of the
      all-to-all layer would sum it; False sums in the dtype of the summands (bf16: half the bytes of those
      transfers, one bf16 rounding per hop).
    - ``link_gbps``: what the cost model takes a transfer to cross (``runtime.cost_model``, the ``ring``
      decision): GB/s of one direction of the slowest link one hop's transfer crosses (an inter-node
      network's per-GPU bandwidth, to plan a ring that spans nodes); ``"auto"``: from the group's backend
      (``transport.link_gbps``: NCCL an NVLink-class link, 450, or 50 across nodes; a group without device
      links, such as the one-GPU stand-in, device copies). Not checked alike: a call decides with the slowest
      link any rank reports (``decision.agreed_link``), a compile-time keep with this rank's own.
    - ``save_projections``: the expert ring's forward keeps every pair's first projection (``T*K`` rows of
      ``2F`` for SwiGLU) until the backward, whose hops then skip recomputing that GEMM (a sixth of the
      ring's GEMM flops). True wherever the ring runs in expert routing with grouped FFN experts (scores
      after them, no chunk graphs); ``"auto"``: where the cost model predicts the ring without them slower
      than the all-to-all, or faster by less than its error (``cost_model.SAVE_MARGIN``), and its peak with
      them still no higher than the all-to-all's (CUDA; never elsewhere); False: never. Decided before the op,
      per rank; a call saves where every rank's op does and the expert ring runs (``agreement``).
    - ``gather_in_gemm``: a hop's first GEMMs read their rows at the tokens' indices
      (``kernels.gathered_grouped_mm``) instead of gathering them into an ``(S, H)`` buffer first (CUDA, 16-bit
      rows, grouped FFN experts without biases): the forward's first projection, with SwiGLU in its epilogue
      (``kernels.swiglu_gemm``); for SwiGLU experts the backward's ``dy @ w2`` and recomputed first projection
      (SwiGLU's backward in its epilogue) too, storing the rows they read for the weight gradients (which ran
      1.6x slower reading them at their indices). A per-rank knob.
    - ``add_in_gemm``: a hop's last GEMMs (the forward's down projection, the backward's ``dx``) add their rows
      into the ring's fp32 ``(T, H)`` sums in their epilogue instead of writing them for a scatter-add (the same
      experts, sums held on this rank: not token routing's arriving ones). A per-rank knob.
    """

    routing: str = "auto"
    overlap: bool = True
    remat: bool = True
    max_hop_rows: MaxHopRows = "auto"
    fp32_accumulation: bool = True
    chunk_graphs: ChunkGraphs = False
    ring: str = "auto"
    fp8: bool = False
    link_gbps: LinkGbps = "auto"
    save_projections: SaveProjections = "auto"
    gather_in_gemm: bool = False
    add_in_gemm: bool = False

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise InvalidRingOption(f"routing={self.routing!r} is not one of {ROUTINGS}", "routing")
        if self.ring not in RINGS:
            raise InvalidRingOption(f"ring={self.ring!r} is not one of {RINGS}", "ring")
        bound = self.max_hop_rows
        if bound is not None and bound != "auto" and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 1):
            raise InvalidRingOption(f"max_hop_rows must be a positive row count, 'auto' or None, got {bound!r}",
                                    "max_hop_rows")
        if self.chunk_graphs != "auto" and not isinstance(self.chunk_graphs, bool):
            raise InvalidRingOption(f"chunk_graphs must be True, False or 'auto', got {self.chunk_graphs!r}",
                                    "chunk_graphs")
        link = self.link_gbps
        if link != "auto" and (isinstance(link, bool) or not isinstance(link, (int, float)) or not 0 < link < 1e6):
            raise InvalidRingOption(f"link_gbps must be 'auto' or a positive bandwidth in GB/s, got {link!r}",
                                    "link_gbps")
        if self.save_projections != "auto" and not isinstance(self.save_projections, bool):
            raise InvalidRingOption(f"save_projections must be True, False or 'auto', got {self.save_projections!r}",
                                    "save_projections")
        for name in ("overlap", "remat", "fp32_accumulation", "fp8", "gather_in_gemm", "add_in_gemm"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRingOption(f"{name} must be a bool, got {getattr(self, name)!r}", name)

    @classmethod
    def checked(
        cls, caller: str, *, routing: str = "auto", overlap: bool = True, remat: bool = True,
        max_hop_rows: MaxHopRows = "auto", fp32_accumulation: bool = True, chunk_graphs: ChunkGraphs = False,
        ring: str = "auto", fp8: bool = False, link_gbps: LinkGbps = "auto",
        save_projections: SaveProjections = "auto", gather_in_gemm: bool = False, add_in_gemm: bool = False,
    ) -> RingOptions:
        """``RingOptions(...)``; a bad value raises ``InvalidRingOption("<caller>: <problem>")``."""
        try:
            return cls(routing=routing, overlap=overlap, remat=remat, max_hop_rows=max_hop_rows,
                       fp32_accumulation=fp32_accumulation, chunk_graphs=chunk_graphs, ring=ring, fp8=fp8,
                       link_gbps=link_gbps, save_projections=save_projections, gather_in_gemm=gather_in_gemm,
                       add_in_gemm=add_in_gemm)
        except InvalidRingOption as e:
            raise InvalidRingOption(f"{caller}: {e.problem}", e.argument) from None

    def key(self) -> str:
        """The options' part of a ring's spec key (stable across processes and ranks)."""
        return (
            f"routing={self.routing}|overlap={int(self.overlap)}|remat={int(self.remat)}"
            f"|max_hop_rows={self.max_hop_rows}|fp32_accumulation={int(self.fp32_accumulation)}"
            f"|chunk_graphs={self.chunk_graphs if self.chunk_graphs == 'auto' else int(self.chunk_graphs)}"
            f"|ring={self.ring}" + ("|fp8=1" if self.fp8 else "")
            + ("" if self.link_gbps == "auto" else f"|link_gbps={float(self.link_gbps):g}")
            + ("" if self.save_projections == "auto" else f"|save_projections={int(self.save_projections)}")
            + ("|gather_in_gemm=1" if self.gather_in_gemm else "") + ("|add_in_gemm=1" if self.add_in_gemm else "")
        )

    @property
    def saves_code(self) -> int:
        """What a ring op that can save projections claims in the agreement (``agreement.Claims.saves``): 1 for
        ``"auto"``, 2 for True, 0 for False."""
        return {True: 2, False: 0}.get(self.save_projections, 1)  # type: ignore[arg-type]

    def graphs_on(self, device: torch.device) -> bool:
        """Whether ``chunk_graphs`` runs padded chunks as static-shape programs on ``device``."""
        return device.type == "cuda" if self.chunk_graphs == "auto" else bool(self.chunk_graphs)

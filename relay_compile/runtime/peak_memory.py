"""The per-rank peak memory of one MoE block, forward + backward, run as its all-to-all or as a ring: what
``cost_model.choose`` weighs where memory decides (``ring="memory"``, saved projections) and what ``explain`` and
``report.json`` print. Legend: T tokens per rank, H hidden, F expert width, K top-k, E_l experts per rank, W one
expert's bytes as it circulates, S rows of a chunk.

The big buffers only, element counts times bytes:

- a2a: ``P = T*K`` expanded rows; forward builds and autograd keeps the permuted send, the received rows, the
  permuted and unpermuted expert input/output and the combined rows (~``6*P*H``) plus the expert intermediates
  (~``4*P*F``); backward frees as it goes but gradients of the same sizes coexist with them.
- ring, the larger of its forward's and its backward's (above the inputs and the local weights, as measured):
  expert routing's backward holds ``dx``'s fp32 sum and the result narrowed from it (``T*H*(4 + elem)``), one
  chunk's rows of the packed widths (``S*(2H + 3F)*elem``: the fused hop kernels' gathered rows, projections and
  their gradients), the weights computed and arriving (``2 * E_l * W``, as they circulate), their fp32 sums summed
  and arriving and this rank's returned gradients (by elements: seven partitions' bytes in bf16); its forward
  ``y``'s sum, rows and two partitions. Token routing's holds the visiting tokens (backward with ``dy``) computed
  and arriving, their fp32 sums sent and arriving, ``dx``'s result, the rows, and this rank's experts' fp32
  weight-gradient sums and their result. A ring of ``g`` partitions per hop holds ``g - 1`` more owners' rows and
  partitions, or sources' tokens and sums, in the direction that stacks them (``ring_options.stack_extra_bytes``).
  Against 69 peaks measured on the GPU (Qwen3 layer, bf16, EP 8 and 64, 4096-131072 tokens: ``docs/bench/memory-model/check.py``): the expert
  ring within 0.97-1.10x (saved projections 0.99-1.07x), token rings 0.77-1.23x; the model before (one formula
  for both routings, ``3*T*H`` fp32 accumulators, four partitions, ``S*(4H + 4F)`` per row) predicted the expert
  ring at 0.72-1.88x and the token ring at 0.59-1.12x. On the CPU, whose hops run eager reference paths, a row
  holds about twice the packed widths (``report``'s reference shape).
"""

from __future__ import annotations

from relay_compile.routing import Routing
from relay_compile.runtime.block_shape import BlockShape, hop_shape, saved_projection_bytes
from relay_compile.runtime.ring_options import MaxHopRows, hop_row_bound, stack_extra_bytes

# What the ring sums across hops is summed in fp32 (``fp32_accumulation``, the default): bytes of one element.
SUM_ELEM_BYTES = 4
# Token routing's routing metadata per routed pair as it travels: an int64 id and a score (counted at 4 bytes).
_ROUTING_PAIR_BYTES = 8 + 4


def _chunk_rows(shape: BlockShape, max_hop_rows: MaxHopRows, *, forward: bool) -> int:
    """Rows one chunk of a hop of one partition computes: its ``T*K/N`` rows, cut at the chunk bound (a stack's
    more partitions add theirs in ``ring_options.stack_extra_bytes``)."""
    rows = -(-shape.tokens * shape.top_k // shape.group_size)
    bound = hop_row_bound(max_hop_rows, shape.tokens, forward=forward)
    return min(rows, bound) if bound else rows


def predicted_peak_bytes(shape: BlockShape, max_hop_rows: MaxHopRows = None,
                         owners: tuple[int, int] = (1, 1), saved: bool = False,
                         sources: tuple[int, int] = (1, 1), routing: Routing = "expert") -> dict[str, int]:
    """Predicted per-rank peak bytes of forward + backward of the block above its inputs and weights (module
    docstring): ``a2a``, and ``ring``, the ring in ``routing`` (``owners``: the expert ring's per forward /
    backward hop; ``sources``: the token ring's), the larger of its forward's and its backward's; ``saved``: the
    expert ring holds the saved projections from one to the other. The ring's default programs (``remat``: a
    replayed backward, ``remat=False``, holds every hop's activations besides, which this does not count)."""
    s = shape
    pairs = s.tokens * s.top_k
    a2a = pairs * (6 * s.hidden + 4 * s.ffn) * s.elem_bytes
    hop = hop_shape(s)
    g_f, g_b = owners if routing == "expert" else sources
    extra_f, extra_b = stack_extra_bytes(hop, routing, g_f, g_b)
    # A partition as it circulates (``expert_bytes``: FP8 hops move one byte a weight), and its weight gradients
    # by elements: summed in fp32, returned in the tokens' dtype (the given weights').
    th, partition = s.tokens * s.hidden, s.experts_per_rank * s.expert_bytes
    grad_sums, grads = (s.experts_per_rank * s.params * b for b in (SUM_ELEM_BYTES, s.elem_bytes))
    rows_f = _chunk_rows(s, max_hop_rows, forward=True) * hop.row_bytes
    rows_b = _chunk_rows(s, max_hop_rows, forward=False) * hop.row_bytes
    if routing == "expert":
        # y's sum; the weights computed and arriving. Backward: dx's sum and the result narrowed from it; the
        # weights computed and arriving, their fp32 sums summed and arriving, this rank's returned gradients.
        forward = th * SUM_ELEM_BYTES + rows_f + 2 * partition + extra_f
        backward = th * (SUM_ELEM_BYTES + s.elem_bytes) + rows_b + 2 * partition + 2 * grad_sums + grads + extra_b
        held = saved_projection_bytes(s) if saved else 0
        return {"a2a": a2a, "ring": max(forward, backward) + held}
    # Token routing: the visiting tokens (backward with dy) computed and arriving, their sums sent and arriving;
    # backward also dx's result, and this rank's experts' fp32 weight-gradient sums and their result.
    routing_bytes = s.tokens * s.top_k * _ROUTING_PAIR_BYTES
    forward = 2 * (th * s.elem_bytes + routing_bytes) + 2 * th * SUM_ELEM_BYTES + rows_f + extra_f
    backward = (2 * (2 * th * s.elem_bytes + routing_bytes) + 2 * th * SUM_ELEM_BYTES + th * s.elem_bytes + rows_b
                + grad_sums + grads + extra_b)
    return {"a2a": a2a, "ring": max(forward, backward)}

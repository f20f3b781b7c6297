"""``relaymoe::split_all_to_all``: an all-to-all of rows whose split sizes are tensors, read by the op itself.

    relaymoe::split_all_to_all(x, send_N, recv_N, group_name, rows=None) -> out
        out: the rows rank s sent to this rank, in rank order: ``recv_N[s]`` rows from rank s, ``sum(recv_N)``
        in all; ``x``'s first ``send_N[0]`` rows went to rank 0, the next ``send_N[1]`` to rank 1, ...

What ``passes.split_reads`` puts in place of an ``all_to_all_single`` whose split lists a graph read element by
element from tensors. Dynamo traces ``splits.tolist()`` into one ``.item()`` per element: 2N unbacked SymInts
per token all-to-all at EP=N, each with its runtime asserts and symbolic sums, which the compiled graph runs on
the host at every call (about 1 ms per MoE layer at EP=64) and inductor's sympy reasons about at compile time
(minutes at EP=64). This op reads both lists with one ``tolist`` each (one device sync where the tensors are on
a device, none where they are host copies), so a graph holds one unbacked SymInt per all-to-all: its output's
row count. ``rows``, where the graph knows that count (a combine sends back the rows a dispatch took in), is
the output's row count instead, checked at run time.

Differentiable in ``x``: the backward is the same op with the two split tensors swapped, its output the rows
``x`` had. The split tensors are integer counts (not differentiable); they are saved for the backward, which
reads them again there (no sync where they are host copies, as ``passes.host_reads`` makes them; one per read
where they are on a device). A collective: registered as having a side effect, so dead-code elimination keeps
it where its result is unused (the peers wait in it too).
"""

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.fx.experimental.symbolic_shapes import _constrain_range_for_size


def _split_sizes(send_N: Tensor, recv_N: Tensor) -> tuple[list[int], list[int]]:
    """Both lists with one host read: one copy for the two where either is on a device."""
    if send_N.device.type == "cpu" and recv_N.device.type == "cpu":
        return send_N.tolist(), recv_N.tolist()
    send, recv = torch.stack([send_N.to(recv_N.device), recv_N]).tolist()
    return send, recv


# No ``from __future__ import annotations`` here: torch.library reads the signature's annotations as types.
@torch.library.custom_op("relaymoe::split_all_to_all", mutates_args=())
def split_all_to_all(x: Tensor, send_N: Tensor, recv_N: Tensor, group_name: str,
                     rows: Optional[int] = None) -> Tensor:
    """Rows ``send_N[o]`` of ``x`` to rank ``o``, ``recv_N[s]`` rows from rank ``s`` (module docstring)."""
    send, recv = _split_sizes(send_N, recv_N)
    received = sum(recv)
    if rows is not None and received != rows:
        raise RuntimeError(f"relaymoe::split_all_to_all: the graph expects {rows} rows back but the split sizes "
                           f"receive {received} ({recv}): the split tensors do not describe this all-to-all")
    out = x.new_empty((received, *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=_resolve_process_group(group_name))
    return out


@split_all_to_all.register_fake
def _(x: Tensor, send_N: Tensor, recv_N: Tensor, group_name: str, rows: Optional[int] = None) -> Tensor:
    """Rows ``rows`` where the graph knows them, else a new unbacked size."""
    if rows is None:
        rows = _unbacked_rows()
    return x.new_empty((rows, *x.shape[1:]))


def _unbacked_rows() -> torch.SymInt:
    """A new unbacked size. Not ``ctx.new_dynamic_size()``: it refuses unless Dynamo allows data-dependent
    output shapes (fullgraph, or ``capture_dynamic_output_shape_ops``), but the graph this op replaces already
    held data-dependent shapes (its split sizes were unbacked ``.item()`` reads), so it is made as torch's own
    ``device_mesh`` fake makes one: from the shape env, with the bounds of a size."""
    shape_env = torch.library.get_ctx()._shape_env
    if shape_env is None:
        raise torch._subclasses.fake_tensor.DynamicOutputShapeException(torch.ops.relaymoe.split_all_to_all.default)
    rows = shape_env.create_unbacked_symint()
    _constrain_range_for_size(rows, min=0)
    return rows


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    """Saves the split tensors, the group and ``x``'s rows (the backward's output rows)."""
    x, send_N, recv_N, group_name, _ = inputs
    ctx.save_for_backward(send_N, recv_N)
    ctx.group_name, ctx.rows = group_name, x.shape[0]


def _backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None, None, None]:
    """The rows' gradients back to their senders: the all-to-all with the two split tensors swapped."""
    send_N, recv_N = ctx.saved_tensors
    dx = split_all_to_all(grad_out, recv_N, send_N, ctx.group_name, ctx.rows)
    return dx, None, None, None, None


split_all_to_all.register_autograd(_backward, setup_context=_setup_context)

SPLIT_ALL_TO_ALL = torch.ops.relaymoe.split_all_to_all.default
torch.fx.node.has_side_effect(SPLIT_ALL_TO_ALL)

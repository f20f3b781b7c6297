"""What both ring steps (``hop_compute.ExpertRoutingStep``, ``token_routing_step.TokenRoutingStep``) share:
running a step inside a ``transport.RingRun`` so that a failure drains instead of leaving (``drains``), the sums a
hop adds into as its transfer brings them (``arrived_sums``), a transfer's receive buffers, the ``g`` sums a
grouped ring returns to each partition's owner, and the counts of a ring of one.

Inside a multi-rank ``RingRun`` a step never raises out of a hop: the first exception marks the run failed, and
its setup, hops and ``finish`` then return what an ``idle`` function gives (zeros of the partials' shapes, the
arriving sums unchanged) without computing, so the program completes every transfer (``_guarded``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from relay_compile.routing import PairRouting
from relay_compile.runtime.agreement import StepCounts, raise_bad_ids
from relay_compile.runtime.segment_compute import HopActivations, RingStepConfig
from relay_compile.runtime.transport import RingTransfer, RingTransportError, active_run, receive_buffers

_Method = TypeVar("_Method", bound=Callable[..., Any])
# ``step`` below is either ring step (``hop_compute.RingStep``), typed ``Any``: this module sits below both.


def unallocated_zeros(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Zeros of ``t``'s shape (and dtype, or ``dtype``) without allocating them (materialized only where they
    are sent)."""
    return t.new_zeros((), dtype=dtype).expand(t.shape)


def _guarded(method: Callable[..., object], idle: Callable[..., object], step: Any, *args: object) -> object:
    """``method(step, *args)``; inside a multi-rank ``RingRun``, an exception marks the run failed instead of
    leaving, and from then on ``idle(step, *args)`` stands in for every guarded computation of the run.

    ``idle`` gives zeros of the partials' shapes, so the program still posts and completes every transfer of
    the schedule and no peer waits on this rank (``transport`` says how the failure is then reported). A
    step driven directly (no run) or a ring of one raises at once.
    """
    run = active_run()
    if run is None or not run.drains:
        return method(step, *args)
    if run.failure is None:
        try:
            return method(step, *args)
        except RingTransportError:  # the link itself failed (a hop waiting for the sums it adds into): as ring_wait
            raise
        except Exception as e:  # noqa: BLE001 -- any failure: the run raises it once the ring's transfers are done
            hop = f" of hop {args[0]}" if args and isinstance(args[0], int) else ""
            run.fail(e, f"{method.__name__}{hop} of {type(step).__name__}")
    return idle(step, *args)


def drains(idle: Callable[..., object]) -> Callable[[_Method], _Method]:
    """A step method run through ``_guarded``, ``idle(step, *args)`` standing in once the run failed."""

    def wrap(method: _Method) -> _Method:
        @functools.wraps(method)
        def drained(self, *args):
            return _guarded(method, idle, self, *args)

        return drained  # type: ignore[return-value]

    return wrap


def no_partials(step: Any, *args: object) -> tuple[Tensor, ...]:
    return ()


def arrived_sums(transfer: RingTransfer, first: int) -> tuple[Tensor, ...]:
    """The sums arriving with ``transfer`` from its received position ``first`` on, once their batch arrived."""
    assert transfer.trailing_from in (0, first), "ring_step: the sums start where the transfer split its batches"
    return transfer.wait_trailing() if transfer.trailing_from else transfer.wait()[first:]


def incoming_sums(step: Any, hop: int, transfer: RingTransfer, first: int, *args: object) -> tuple[Tensor, ...]:
    """The incoming trailing sums, unchanged (a hop summing in place: expert routing's weight gradients, token
    routing's ``y``, ``dx`` and ``d_scores``)."""
    return transfer.wait()[first:]


def no_activations(step: Any, *args: object) -> HopActivations:
    return HopActivations()


def trailing_as_is(step: Any, *trailing: Tensor) -> tuple[Tensor, ...]:
    return trailing


def grouped_receive_buffers(
    cfg: RingStepConfig, hop: int, num_circulating: int, specs: Sequence[tuple[Sequence[int], torch.dtype]],
    device: torch.device,
) -> list[Tensor]:
    """A transfer's receive buffers: the circulating tensors in one buffer, the trailing accumulators in another
    (``transport``: each group travels as one span and keeps its own lifetime). The ring's last transfer returns
    the accumulators to their owners: they become the op's outputs, which must not alias (separate tensors)."""
    flat = hop < cfg.ring.size
    return (receive_buffers(specs[:num_circulating], device, flat=flat)
            + receive_buffers(specs[num_circulating:], device, flat=flat))


def guarded_setup(step: Any, plan: Callable[..., None], *args: object) -> None:
    """The step's planning after the agreement, guarded like a hop (a failure there drains too)."""
    _guarded(plan, no_partials, step, *args)


def local_counts(cfg: RingStepConfig, x_TH: Tensor, topk_ids_TK: Tensor) -> StepCounts:
    """The counts of a ring of one, without an agreement (a step driven directly); raises on bad ids."""
    assert cfg.ring.size == 1, "ring_moe: a step of a multi-rank ring plans from the agreed counts"
    ids_TK, bad = clamped_ids(cfg.num_experts, topk_ids_TK)
    # NOTE: device-to-host sync, once per step.
    local_bad, *counts = torch.cat([bad, PairRouting.counts(ids_TK, cfg.num_experts)]).tolist()
    if local_bad:
        raise_bad_ids(cfg.ring.rank, cfg.num_experts, [cfg.ring.rank])
    return StepCounts(tokens_N=[x_TH.shape[0]], counts_NE=[counts])


def sum_slots(trailing: Sequence[Tensor], g: int) -> tuple[Tensor, ...]:
    """The trailing sums a grouped ring of ``g`` partitions per hop returned to this rank (``g`` transfers, each
    one slot: every tensor of the trailing set, in order), added: each slot holds the contributions of one residue
    class of ranks mod ``g``, so together they hold every rank's."""
    n = len(trailing) // g
    return tuple(functools.reduce(torch.add, trailing[i::n]) for i in range(n))


def clamped_ids(num_experts: int, topk_ids_TK: Tensor) -> tuple[Tensor, Tensor]:
    """Ids safe to count with, and a ``(1,)`` int64 flag: does this rank hold ids outside ``[0, E)``?"""
    bad = ((topk_ids_TK < 0) | (topk_ids_TK >= num_experts)).any().to(torch.int64).reshape(1)
    return topk_ids_TK.clamp(0, num_experts - 1), bad

"""A ``torch.distributed.ProcessGroup`` written in Python: its identity under the torch 2.11 and 2.13 names, and
the coalesced collectives as loops over the single ones.

A ``Backend`` subclass cannot be constructed from Python, so the bench's simulated groups (``standin_group``,
``rank_threads``) subclass ``ProcessGroup`` itself and answer c10d's identity queries here (rank, size, backend
name, group name and description, each under every name torch calls it by); their operations are their own; the coalesced variants torch may call run them one by one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import _create_work_from_future

__all__ = ["PythonProcessGroup", "completed_work"]


def completed_work(result: Any = None) -> dist.Work:
    """A ``Work`` already completed with ``result``."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class PythonProcessGroup(dist.ProcessGroup):
    """Rank ``rank`` of ``size``, registered as backend ``backend``; the name and description c10d sets."""

    def __init__(self, rank: int, size: int, backend: str) -> None:
        super().__init__(rank, size)
        self._rank, self._size, self._backend = rank, size, backend
        self._name = ""
        self._desc = ""

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def getRank(self) -> int:
        return self._rank

    def getSize(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        return self._backend

    def name(self) -> str:
        return self._backend

    @property
    def group_name(self) -> str:
        return self._name

    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_desc(self) -> str:
        return self._desc

    def getGroupDesc(self) -> str:
        return self._desc

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self._rank}, size={self._size}, name={self._name!r})"

    # --- coalesced collectives: one by one (subclasses define the single ones) --------------------------

    @torch.compiler.disable
    def all_gather_single_coalesced(self, outputs: list[Tensor], inputs: list[Tensor], opts: Any = None) -> dist.Work:
        for out, inp in zip(outputs, inputs, strict=True):
            self.all_gather_single(out, inp)
        return completed_work(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @torch.compiler.disable
    def allgather_coalesced(self, output_lists: list[list[Tensor]], input_list: list[Tensor],
                            opts: Any = None) -> dist.Work:
        return self.allgather(output_lists, input_list, opts)

    @torch.compiler.disable
    def allreduce_coalesced(self, tensors: list[Tensor], opts: Any = None) -> dist.Work:
        return self.allreduce(tensors, opts)

    @torch.compiler.disable
    def reduce_scatter_single_coalesced(self, outputs: list[Tensor], inputs: list[Tensor],
                                        opts: Any = None) -> dist.Work:
        for out, inp in zip(outputs, inputs, strict=True):
            self.reduce_scatter_single(out, inp, opts)
        return completed_work(outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

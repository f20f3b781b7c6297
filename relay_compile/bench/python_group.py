"""A ``torch.distributed.ProcessGroup`` written in Python: its identity under the torch 2.11 and 2.13 names.

A ``Backend`` subclass cannot be constructed from Python, so the bench's simulated groups (``standin_group``,
``rank_threads``) subclass ``ProcessGroup`` itself and answer c10d's identity queries here (rank, size, backend
name, group name and description, each under every name torch calls it by); their operations are their own.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["PythonProcessGroup"]


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

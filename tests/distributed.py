"""Shared multi-process test harness: gloo process groups on CPU, one spawned process per rank.

    class MyTest(DistributedTestCase):
        @property
        def world_size(self) -> int:
            return 4

        def test_something_holds(self) -> None:
            group = self.init_pg()
            ...  # runs on every rank; self.rank is this rank

Each test method spawns ``world_size`` fresh processes, each importing torch (seconds of CPU apiece): put several
cases in one method. A child whose test passed exits with ``os._exit(0)`` right away: interpreter teardown costs
seconds per process and on CPU sometimes aborts with "terminate called without an active exception" after all
work is done (docs/ARCHITECTURE.md section 5). A failing child reports its traceback to the parent as usual.
"""

from __future__ import annotations

import datetime
import os
import sys
import types
import unittest.mock
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase

# A rank stuck in a collective because a peer failed gives up after this long, not gloo's 30 minutes.
PG_TIMEOUT = datetime.timedelta(seconds=120)


class DistributedTestCase(MultiProcessTestCase):
    """``MultiProcessTestCase`` for gloo on CPU; override ``world_size`` (default 2)."""

    @property
    def world_size(self) -> int:
        return 2

    def setUp(self) -> None:
        super().setUp()
        # Children inherit the environment: one OpenMP thread each, or N ranks oversubscribe the cores.
        with unittest.mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1"}):
            self._spawn_processes()

    def tearDown(self) -> None:
        super().tearDown()
        Path(self.file_name).unlink(missing_ok=True)

    def init_pg(self, backend: str = "gloo") -> dist.ProcessGroup:
        """Start the default process group of this rank from a FileStore; returns ``dist.group.WORLD``.

        The harness destroys it when the test body returns.
        """
        torch.set_num_threads(1)
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group(
            backend, store=store, rank=self.rank, world_size=self.world_size, timeout=PG_TIMEOUT
        )
        return dist.group.WORLD

    def join_or_run(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """Parent: join the children. Child: run the test body, then destroy the process group."""

        @wraps(fn)
        def wrapper(self: DistributedTestCase) -> None:
            if self.rank == self.MAIN_PROCESS_RANK:
                self._join_processes(fn)
                return
            fn()
            if dist.is_initialized():
                dist.destroy_process_group()

        return types.MethodType(wrapper, self)

    @classmethod
    def _run(cls, rank: int, test_name: str, file_name: str, parent_pipe: Any, **kwargs: Any) -> None:
        """Child entry point. A failed or skipped test leaves through ``sys.exit`` inside ``super()._run``;
        a passed one skips interpreter teardown, which costs seconds per process and sometimes aborts in C++
        destructors ("terminate called without an active exception")."""
        super()._run(rank, test_name, file_name, parent_pipe, **kwargs)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

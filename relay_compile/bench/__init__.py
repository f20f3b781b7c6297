"""Benchmarks of one MoE layer on one device with simulated expert parallelism (``python -m relay_compile.bench``).

- ``standin_group``: rank 0 of an N-rank EP group whose peers are stand-ins (copies of this rank).
- ``single_layer``: per-rank forward+backward latency and peak memory of the all-to-all baseline beside ring
  variants, sweeps, a capacity search and memory-over-time plots.
"""

from relay_compile.bench.standin_group import (
    StandinError,
    StandinGroup,
    destroy_standin_groups,
    drop_pending_messages,
    standin_group,
)

__all__ = ["StandinError", "StandinGroup", "destroy_standin_groups", "drop_pending_messages", "standin_group"]

"""Benchmarks of one MoE layer on one device with simulated expert parallelism (``python -m relay_compile.bench``).

Per-rank forward+backward latency and peak memory of the all-to-all baseline beside ring variants, sweeps, a
capacity search and memory-over-time plots. Modules, in data-flow order:

- ``standin_group``: rank 0 of an N-rank EP group whose peers are stand-ins (copies of this rank).
- ``configs``: what to measure: ``LayerConfig`` (one layer on one rank), the paper's layers, ``BenchOptions``.
- ``inputs``: the tensors of one measurement (tokens, Qwen3 routing, this rank's experts, output gradient).
- ``rows``: ``RowSpec``, how each row of a table runs the layer (eager / compiled a2a, ring variants).
- ``torchtitan_rows``: torchtitan's MoE layer as rows (eager, compiled), on a stand-in world its mesh code builds on.
- ``compile_time``: compile time of compiled rows (first call minus a steady step, fresh Dynamo state per row).
- ``link_model``: the modeled link time the stand-in group does not simulate.
- ``measure``: timing and peak memory of every row on one configuration (``measure_layer``).
- ``capacity``: the largest tokens per rank that fit a memory budget (``capacity_search``).
- ``timeline``: memory over one forward+backward (``record_timeline``, through ``relay_compile.memory``).
- ``results``: ``Report``, written as results.json, results.md and memory_timeline.png.
- ``progress``: the printed progress lines and number formats the modules above share.
- ``__main__``: presets and the command line.
"""

from relay_compile.bench.standin_group import (
    StandinError,
    StandinGroup,
    destroy_standin_groups,
    drop_pending_messages,
    standin_group,
    standin_world,
)

__all__ = [
    "StandinError", "StandinGroup", "destroy_standin_groups", "drop_pending_messages", "standin_group", "standin_world",
]

"""Full-model training on one device with simulated expert parallelism (issue 14).

A Qwen3-MoE-shaped decoder (``model``) trains with mixed-precision AdamW (``optimizer``) as rank 0 of a stand-in
EP group (``relay_compile.bench.standin_group``), one step at a time (``training``), under rows that differ in
backend and recompute policy (``policies``; the memory-budget policy picks torch's partitioner budget in
``budget``). ``search`` finds each row's largest tokens per rank within the memory budget, ``link`` models
the link time the stand-in does not spend, ``bars`` reads off the issue's bars, ``report`` writes results.json,
results.md and the figure. The CLI is ``python -m relay_compile.bench.full_model`` (``__main__``).
"""

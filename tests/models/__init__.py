"""Test models: the client MoE styles the region matcher must understand (besides ``relay_compile.reference``).

- ``megatron_style``: a CPU stand-in for megatron-core's ``MoEAlltoAllTokenDispatcher`` + ``SequentialMLP``
  (all_gather counts, sort + index_select permutation, a ModuleList of ``nn.Linear`` experts, ``index_add_``).
- ``torchtitan_moe``: torchtitan 0.3.0's ``MoE`` with ``AllToAllTokenDispatcher`` on CPU/gloo.
- ``variants``: reference-layer variants a matcher must refuse (graph break, scores first, F reading tokens).
"""

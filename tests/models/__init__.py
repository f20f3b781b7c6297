"""Test models: the client MoE styles the region matcher must understand (besides ``relay_compile.reference``).

- ``megatron_style``: a CPU stand-in for megatron-core's ``MoEAlltoAllTokenDispatcher`` + ``SequentialMLP``
  (all_gather counts, sort + index_select permutation, a ModuleList of ``nn.Linear`` experts, ``index_add_``).
- ``torchtitan_moe``: torchtitan 0.3.0's ``MoE`` with ``AllToAllTokenDispatcher`` on CPU/gloo.
- ``variants``: reference-layer variants the matcher rewrites (in-place combine, scores first) or must refuse
  (graph break, F reading tokens).
- ``data_dependent``: a dispatcher with data-dependent shapes (repeat_interleave of counts, boolean masks,
  nonzero; megatron-core 0.7's ``permute``).
- ``scores_first``: router scores applied before the experts (torchtitan's ``score_before_experts``).
"""

"""Test models: the client MoE styles the region matcher must understand (besides ``relay_compile.reference``).

- ``megatron_style``: a CPU stand-in for megatron-core's ``MoEAlltoAllTokenDispatcher`` + ``SequentialMLP``
  (all_gather counts, sort + index_select permutation, a ModuleList of ``nn.Linear`` experts, ``index_add_``).
- ``torchtitan_moe``: torchtitan 0.3.0's ``MoE`` with ``AllToAllTokenDispatcher`` on CPU/gloo.
- ``variants``: reference-layer variants the matcher rewrites (in-place combine, scores first) or must refuse
  (graph break, F reading tokens).
- ``data_dependent``: a dispatcher with data-dependent shapes (repeat_interleave of counts, boolean masks,
  nonzero; megatron-core 0.7's ``permute``).
- ``scores_first``: router scores applied before the experts (torchtitan's ``score_before_experts``).
- ``deepspeed_style``: DeepSpeed's ``top2gating`` + ``MOELayer`` + ``Experts`` (capacity-based dispatch: one-hot
  cumsum slots, drops over capacity, einsum into (E, C, M), equal-split all-to-all, ModuleList experts on chunks).
- ``fairseq_style``: the DeepSpeed-style layer with fairseq ``MOELayer``'s mm dispatch and combine.
- ``gshard_style``: GShard/Tutel top-k capacity gating with batched einsum/bmm experts on (E_l, N * C, M).
- ``capacity_variants``: DeepSpeed-style variants the capacity matcher must refuse (scores first, batched-matmul
  dispatch, experts mixing slots or chunking the wrong dimension).
"""

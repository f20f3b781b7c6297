"""Options of the relaymoe backend.

Set them per call, ``torch.compile(model, backend="relaymoe", options={"routing": "token"})``, process-wide
(``relay_compile.config.routing = "token"``, or ``with relay_compile.config.patch(routing="token"):``), or from
the environment (``RELAYMOE_ROUTING=token``). Per-call options win over the module values, which start from the
environment. ``relay_compile.options.resolve`` validates them: an unknown name, a value of the wrong type
(``max_hop_rows=2.7``) or out of range raises ``ValueError`` naming the option. Environment strings are
parsed strictly: booleans ``true``/``false``/``1``/``0``, counts in decimal, directories never ``0``/``1``/
``true``/``false`` (torch's config module reads ``1`` and ``0`` as True and False).

This module holds only the values (``install_config_module`` turns each into a config entry).
"""

import sys

from torch.utils._config_module import Config, install_config_module

# Which side of the ring moves: "expert" circulates expert weights (tokens stay), "token" circulates tokens
# with their routing (experts stay), "auto" picks the one with less traffic per hop from the shapes of all
# ranks at the first call (paper Table 2), identically on every rank.
# (Typed str, not Literal: torch config entries read from the environment must be bool or str.)
routing: str = Config(default="auto", env_name_default="RELAYMOE_ROUTING")

# Post each hop's transfer before the hop's compute and wait as late as possible. False gives the sequential
# ring, for ablation.
overlap: bool = Config(default=True, env_name_default="RELAYMOE_OVERLAP")

# Backward hops recompute their expert activations, consume and release them within the hop. False replays
# the whole block first and keeps every hop's activations (what checkpointing the block would do), for ablation.
remat: bool = Config(default=True, env_name_default="RELAYMOE_REMAT")

# Rows of one expert call: hops with more (token, expert) pairs run in chunks, so the block's peak memory stops
# growing with tokens. "auto": the shape-derived bound
# (``runtime.ring_options.hop_row_bound``); 0 leaves hops whole; a positive int
# is the bound. (RELAYMOE_MAX_HOP_ROWS is read by ``options.resolve``: torch config entries read from the
# environment must be bool or str.)
max_hop_rows: int | str = "auto"

# Sum what the ring accumulates across hops (weight gradients; token routing's travelling outputs and input
# gradients) in fp32, as the all-to-all layer's fp32-accumulating GEMMs do. False sums in the summands' dtype:
# half the bytes of those transfers in bf16, one rounding per hop (docs/BENCHMARKS.md, "bf16 numerics").
fp32_accumulation: bool = Config(default=True, env_name_default="RELAYMOE_FP32_ACCUMULATION")

# Run a hop's chunks at bucketed row counts as CUDA graphs captured once and replayed (``runtime.chunk_graphs``):
# less host work per hop for a host-bound ring, for about one chunk's working set held between steps and a few
# percent more GPU work. "auto": on CUDA; true or false. Off by default (docs/BENCHMARKS.md, "Chunk graphs").
chunk_graphs: str = Config(default="false", env_name_default="RELAYMOE_CHUNK_GRAPHS")

# Whether an MoE block runs as a ring: "auto" where the cost model predicts the ring no slower than the block's
# all-to-all (``runtime.cost_model``: calibrated on the H200, applied on CUDA; elsewhere the ring always runs);
# "memory" also where it is slower but the all-to-all's predicted peak is higher; "always"; "never" keeps the
# all-to-all (for comparisons). Decided at every call from the shapes all ranks agree on.
ring: str = Config(default="auto", env_name_default="RELAYMOE_RING")

# FP8 hops (``runtime.fp8_experts``): expert weights circulate in E4M3 with a scale per expert matrix and the
# hop GEMMs by the weights run in FP8 (``torch._scaled_grouped_mm``); weight gradients and sums across hops stay
# wide. Grouped SwiGLU experts only; off by default (docs/BENCHMARKS.md, "FP8 hops").
fp8: bool = Config(default=False, env_name_default="RELAYMOE_FP8")

# The link the cost model takes one hop's transfer to cross, for the ``ring`` decision: "auto" from the EP group's
# backend (NCCL: an NVLink-class link, 450 GB/s, or 50 GB/s where the group spans nodes by torchrun's
# LOCAL_WORLD_SIZE; a group without device links, such as the one-GPU stand-in: device copies), or GB/s of one
# direction of the slowest link a hop crosses. The group decides with the slowest link any rank reports.
# (RELAYMOE_LINK_GBPS is read by ``options.resolve``: torch's config module reads "1" from the environment as True.)
link_gbps: float | str = "auto"

# The expert ring's forward keeps every pair's first projection for its backward, which then does not recompute
# that GEMM per hop: "auto" where the cost model predicts the ring slower than the all-to-all without them and its
# peak with them no higher than the all-to-all's (CUDA, a static token count); true; false.
save_projections: str = Config(default="auto", env_name_default="RELAYMOE_SAVE_PROJECTIONS")

# Where an MoE region's token count is dynamic and the cost model may keep its all-to-all at some counts (CUDA,
# ring "auto" or "memory"): compile the graph a second time with those regions kept, and pick per call from every
# rank's agreed count (``runtime.token_switch``). False: one compile, the ring op decides per call and runs small
# calls through its own all-to-all path (which recomputes the experts in backward).
dynamic_keep: bool = Config(default=True, env_name_default="RELAYMOE_DYNAMIC_KEEP")

# An all-to-all whose split sizes the graph reads element by element (``splits.tolist()``: 2N unbacked SymInts
# at EP=N) takes them as tensors instead, in one op (``passes.split_reads``): less host time per call and a far
# shorter inductor compile at large EP. False leaves such all-to-alls as traced (for comparisons and debugging;
# the cost model's kept all-to-all time, ``Calibration.kept_a2a_ratio``, assumes the pass ran).
split_reads: bool = Config(default=True, env_name_default="RELAYMOE_SPLIT_READS")

# A hop's first GEMMs read their rows at the tokens' indices (``kernels.gathered_grouped_mm``) instead of gathering
# them into an ``(S, H)`` buffer first: the forward's first projection, with SwiGLU in its epilogue for SwiGLU
# experts (``kernels.swiglu_gemm``: the ``(S, 2F)`` projections never written); for SwiGLU experts also the
# backward's ``dy @ w2`` and recomputed first projection (SwiGLU's backward in its epilogue), which store the rows
# they read for the weight gradients (those ran slower reading rows at their indices). CUDA, 16-bit rows, grouped
# experts without biases. Per call too (``options={"gather_in_gemm": True}``, ``ring_moe(..., gather_in_gemm=True)``).
gather_in_gemm: bool = Config(default=False, env_name_default="RELAYMOE_GATHER_IN_GEMM")

# A hop's last GEMMs (the forward's down projection, the backward's ``dx``) add their rows into the ring's fp32
# ``(T, H)`` sums in their epilogue (``kernels.gathered_grouped_mm``, fp32 atomics) instead of writing them as an
# ``(S, H)`` buffer that a scatter-add reads again: CUDA, 16-bit rows, grouped experts without biases, sums held on
# this rank (not token routing's arriving ones). Per call too, as ``gather_in_gemm``.
add_in_gemm: bool = Config(default=False, env_name_default="RELAYMOE_ADD_IN_GEMM")

# What compiles the graph after the rewrite: "inductor" (aot_autograd + inductor), "aot_eager" (aot_autograd,
# eager kernels: for debugging and for CPU tests), "eager" (run the rewritten Dynamo graph as is).
inner_compiler: str = Config(
    default="inductor", env_name_default="RELAYMOE_INNER_COMPILER"
)

# Directory for debugging dumps: per compiled graph, the graph before and after each pass, the ring programs,
# and report.json. Empty: no dumps. RELAYMOE_DUMP_DIR=0 (or 1, true, false) is refused, not a directory.
dump_dir: str = Config(default="", env_name_default="RELAYMOE_DUMP_DIR")

# Run the original graph beside the rewritten one at the first call and raise if their outputs differ.
verify: bool = Config(default=False, env_name_default="RELAYMOE_VERIFY")

# What the inner compiler's partitioner saves for backward: torch's own activation memory budget
# (``torch._functorch.config.activation_memory_budget``), applied to this compilation only. 1.0 saves what runs
# fastest, 0.0 saves only the graph's inputs and recomputes the rest; in between, torch picks what to recompute
# by runtime per byte. The ring already recomputes its experts per hop, so what the budget trades is the rest
# of the graph (attention, norms, router). None leaves torch's global setting alone. Needs an inner compiler
# with aot_autograd (inductor, aot_eager).
activation_memory_budget: float | None = None


install_config_module(sys.modules[__name__])

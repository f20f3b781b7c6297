"""Passes over Dynamo graphs (installed as ``relay_compile.passes``): all-to-all MoE regions become rings.

    region.py     Region: the protocol every family's record implements (what rewrite, report, backend read)
    match.py      find_moe_regions: MoERegion records (top-k), or RefusedRegion with the reason
    pairing.py    match's step 2: combines paired with dispatches (an unpaired one refused with its cause)
    capacity_match.py   capacity-based dispatch (einsum into (E, C, H) buffers): CapacityRegion records
    rewrite.py    rewrite_moe_region: one region -> one relaymoe::ring_moe call (moe_ring_pass: all of them);
                  keep_all_to_all: a region the cost model keeps as it is, behind an agreement check

and what those two share:

    fx_nodes.py   op identities, the fake-value lookup, narrowing predicates (nothing MoE-specific)
    roles.py      recognizers of the values a dispatcher computes (sort order, row gather, scatter, splits)
    expert_fn.py  F cut out of the region into its own graph (ExpertFnBinding), RegionExpertFn runs it per hop
    expert_block.py     F recognized as an FFN of experts, by abstract interpretation of its graph
    ffn_template.py     the FFN templates that interpretation must match, and their record (ExpertFFN)
    expert_lowering.py  a recognized F on the engine's grouped experts (LoweredFFN), proven on probe inputs
    capacity_pairs.py   a capacity region's (id, score) pairs from its masks, inserted by the rewrite
    liveness.py   the nodes that die when a region's output is replaced
    host_reads.py batch_host_reads: a tensor's elements read on the host (split sizes) through one copy
    split_reads.py fold_split_reads: an all-to-all whose split lists are such reads takes the tensors instead
    refusals.py   RefusedRegion and the exception the matcher raises internally

The passes import the runtime (the op they insert, the spec they register); the runtime never imports them.
"""

from relay_compile.passes.capacity_match import CapacityRegion
from relay_compile.passes.host_reads import HostReads, batch_host_reads, find_host_reads
from relay_compile.runtime.region_fn import ExpertFnBinding, RegionExpertFn
from relay_compile.passes.match import MoERegion, find_moe_regions
from relay_compile.passes.refusals import Refusal, RefusedRegion
from relay_compile.passes.region import Region
from relay_compile.passes.rewrite import (
    guard_refused,
    keep_all_to_all,
    kept_at_compile_time,
    moe_ring_pass,
    rewrite_moe_region,
)

__all__ = [
    "CapacityRegion",
    "HostReads",
    "batch_host_reads",
    "find_host_reads",
    "ExpertFnBinding",
    "MoERegion",
    "Refusal",
    "RefusedRegion",
    "Region",
    "RegionExpertFn",
    "find_moe_regions",
    "moe_ring_pass",
    "rewrite_moe_region",
    "keep_all_to_all",
    "guard_refused",
    "kept_at_compile_time",
]

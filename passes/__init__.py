"""Graph passes of relay-compile (installed as ``relay_compile.passes``).

Ring programs: ``remat`` (hop-scoped rematerialization), ``overlap`` (transfer/compute overlap).
Dynamo graphs: ``match`` (find all-to-all MoE regions), ``rewrite`` (replace each by one ring op).
"""

from relay_compile.passes.overlap import check_overlap, overlap_pass
from relay_compile.passes.remat import remat_pass

# After overlap/remat: relay_compile.runtime.ops imports those two while rewrite imports it.
from relay_compile.passes.match import ExpertFnBinding, MoERegion, RefusedRegion, find_moe_regions
from relay_compile.passes.rewrite import RegionExpertFn, moe_ring_pass, rewrite_moe_region

__all__ = [
    "ExpertFnBinding",
    "MoERegion",
    "RefusedRegion",
    "RegionExpertFn",
    "check_overlap",
    "find_moe_regions",
    "moe_ring_pass",
    "overlap_pass",
    "remat_pass",
    "rewrite_moe_region",
]

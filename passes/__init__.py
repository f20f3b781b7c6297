"""Graph passes of relay-compile (installed as ``relay_compile.passes``).

Ring programs: ``remat`` (hop-scoped rematerialization), ``overlap`` (transfer/compute overlap).
"""

from relay_compile.passes.overlap import check_overlap, overlap_pass
from relay_compile.passes.remat import remat_pass

__all__ = ["check_overlap", "overlap_pass", "remat_pass"]

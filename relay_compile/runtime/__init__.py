"""Runtime of the ring: custom ops, per-hop compute, P2P transport."""

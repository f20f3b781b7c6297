"""What each rank moves per forward + backward of the Qwen3 layer: the ring in either routing against the
all-to-all, and the time those bytes take on a link, beside the all-to-all's measured time (issue 24's bars).

The ring's bytes do not depend on how many owners a hop holds (a stack gathers the same partitions sooner), so no
owner choice changes them; a link this slow or slower bounds the ring's time from below whatever its host and GPU
cost. Bytes as the ring's programs send them (``cost_model.ring_traffic`` over ``routing.per_hop_bytes``: weights
and fp32 weight-gradient sums, or tokens, metadata and fp32 output sums, an upper bound for token routing); the
all-to-all moves its dispatch and combine forward and backward, (N - 1) / N of ``T K H`` elements each.

    python docs/bench/reach/bytes.py [--link-gbps 450] [--measured SWEEP.json ...]
"""
import argparse
import dataclasses
import json

from relay_compile.bench.configs import QWEN3_30B
from relay_compile.routing import per_hop_bytes
from relay_compile.runtime.block_shape import BlockShape
from relay_compile.runtime.cost_model import H200, ring_time, ring_traffic

ap = argparse.ArgumentParser()
ap.add_argument("--link-gbps", type=float, default=450.0, help="one direction of the link a hop crosses")
ap.add_argument("--measured", nargs="*", default=["docs/bench/backend-saving/raw-1-h200/sweep-ep8.json",
                                                  "docs/bench/backend-saving/raw-1-h200/sweep-ep64.json"],
                help="sweep.json files: a2a eager's measured ms at each point")
args = ap.parse_args()
c = QWEN3_30B
expert_bytes = 3 * c.hidden * c.ffn * c.elem_bytes
measured = {}
for path in args.measured:
    for p in json.load(open(path))["rows"]:
        if p["row"] == "a2a eager":
            measured[(p["ep"], p["tokens"])] = p["ms"]
print(f"Qwen3 layer (H={c.hidden}, F={c.ffn}, E={c.experts}, K={c.top_k}, bf16, fp32 sums), "
      f"link {args.link_gbps:g} GB/s")
# The stand-in's floor: the H200 model's expert ring with no host cost at all (GEMMs, row traffic and the
# stand-in's transfers as device copies on the compute stream), the fastest of every owner stack.
no_host = dataclasses.replace(H200, host_hop_us=0.0, host_hop_expert_us=0.0, host_chunk_us=0.0)
print("| EP | tokens/rank | a2a eager ms (measured, H200) | a2a GB | expert ring GB (x a2a) | token ring GB (x a2a) "
      "| link ms: a2a / expert ring / token ring | stand-in floor: expert ring, no host (x a2a) |")
print("|---:|---:|---:|---:|---:|---:|---|---:|")
for ep in (8, 64):
    for tokens in (4096, 8192, 16384, 32768, 65536, 131072):
        hop = {r: per_hop_bytes(r, tokens=tokens, hidden=c.hidden, top_k=c.top_k, experts_per_rank=c.experts // ep,
                                expert_bytes=expert_bytes, elem_bytes=c.elem_bytes,
                                expert_grad_bytes=expert_bytes // c.elem_bytes * 4, sum_elem_bytes=4)
               for r in ("expert", "token")}
        ring = {r: ring_traffic(r, ep, 1, 1, v).total for r, v in hop.items()}  # the same for every stack
        a2a = 4 * tokens * c.top_k * c.hidden * c.elem_bytes * (ep - 1) / ep
        ms = lambda b: b / (args.link_gbps * 1e6)  # noqa: E731
        m = measured.get((ep, tokens))
        shape = BlockShape(tokens=tokens, experts_per_rank=c.experts // ep, group_size=ep, hidden=c.hidden,
                           ffn=c.ffn, top_k=c.top_k, elem_bytes=c.elem_bytes, expert_bytes=expert_bytes)
        stacks = [g for g in (1, 2, 4, 8, 16, 32) if g <= ep // 2 or g == 1]
        floor = min(ring_time(shape, "expert", no_host, owners_per_hop=f, backward_owners=b).total_ms
                    for f in stacks for b in stacks)
        print(f"| {ep} | {tokens} | {'' if m is None else f'{m:.1f}'} | {a2a / 1e9:.2f} | {ring['expert'] / 1e9:.2f} "
              f"({ring['expert'] / a2a:.1f}x) | {ring['token'] / 1e9:.2f} ({ring['token'] / a2a:.1f}x) | "
              f"{ms(a2a):.1f} / {ms(ring['expert']):.1f} / {ms(ring['token']):.1f} | {floor:.1f}"
              + ("" if m is None else f" ({floor / m:.2f}x)") + " |")

"""What the time model decides for the Qwen3-30B-A3B MoE layer (H=2048, F=768, E=128, K=8, bf16), with no device:
the predictions behind ``ring="auto"`` (``runtime.cost_model.choose``, H200 constants).

    python docs/bench/model-decisions/decisions.py

Table 1: owners per hop. The op holds ``grouped_owners`` per forward / backward hop (grouped experts); the
decisions made before the op (compile-time keep, token switch, report) used to predict one owner per hop.
Table 2: the link a hop crosses (option ``link_gbps``): device copies (the one-GPU stand-in the constants were
fitted on), NVLink-class (NCCL within a node, the default there), an inter-node network (NCCL across nodes).
Cells: what runs, and the predicted ring (expert routing) time over the all-to-all's. Table 1 also for a wider
layer (H=4096, F=1536, E=64, K=6) at EP=64. Last: where the NVLink decision changes with T at EP=64 (not
monotonic: owners per hop step down as hops grow).
"""
from relay_compile.bench.calibrate import shape_of
from relay_compile.runtime.block_shape import grouped_owners
from relay_compile.runtime.cost_model import H200, INTER_NODE_GBPS, NVLINK_GBPS, choose

LAYER = dict(hidden=2048, ffn=768, experts=128, top_k=8)
WIDE = dict(hidden=4096, ffn=1536, experts=64, top_k=6)


def cell(shape, **kw) -> str:
    c = choose(shape, routing="auto", ring="auto", **kw)
    return f"{c.execution} {c.times['expert'].total_ms / c.times['a2a'].total_ms:.2f}x"


print("| EP | tokens | owners fwd/bwd | one owner per hop | grouped owners (the op) |")
print("| ---: | ---: | --- | --- | --- |")
for layer, eps in ((LAYER, (8, 64)), (WIDE, (64,))):
    for ep in eps:
        for tokens in (4096, 8192, 16384, 32768, 65536, 131072):
            s = shape_of(layer, ep, tokens)
            f, b = grouped_owners(s)
            wide = " (H=4096)" if layer is WIDE else ""
            print(f"| {ep}{wide} | {tokens} | {f}/{b} | {cell(s, cal=H200, owners=(1, 1))} | {cell(s, cal=H200)} |")
print()
print(f"| EP | tokens | device copies | {NVLINK_GBPS:g} GB/s | {INTER_NODE_GBPS:g} GB/s |")
print("| ---: | ---: | --- | --- | --- |")
for ep in (8, 64):
    for tokens in (4096, 8192, 16384, 32768, 65536):
        s = shape_of(LAYER, ep, tokens)
        cells = [cell(s, cal=H200.with_link(link)) for link in (None, NVLINK_GBPS, INTER_NODE_GBPS)]
        print(f"| {ep} | {tokens} | " + " | ".join(cells) + " |")
print()
nvlink = H200.with_link(NVLINK_GBPS)
previous, changes = None, []
for tokens in range(16384, 65537, 512):
    execution = choose(shape_of(LAYER, 64, tokens), routing="auto", ring="auto", cal=nvlink).execution
    if execution != previous:
        changes.append(f"{tokens}: {execution}")
    previous = execution
print(f"EP=64, {NVLINK_GBPS:g} GB/s, T from 16384 in steps of 512: " + ", ".join(changes))

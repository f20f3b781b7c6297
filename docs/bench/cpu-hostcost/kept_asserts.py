"""A kept region's compile overhead on the CPU (issue 24, 2026-12-05): the reference layer a2a_moe eager, compiled by
aot_eager as traced, and compiled with its runtime asserts erased (``_assert_scalar`` on each split size, u >= 0, and
on the splits' sum), on the stand-in group at tiny shapes (host work dominates). An exploration, not a pass.

    OMP_NUM_THREADS=1 python docs/bench/cpu-hostcost/kept_asserts.py [EP]

Output, 2 cores shared (median of 15 interleaved fwd+bwd; two runs at EP=64, one at EP=8):
    EP=64: eager 4.17 / 4.23 ms, aot_eager 5.43 / 5.44 ms, asserts erased 4.73 / 4.87 ms
    EP=8:  eager 4.58 ms,        aot_eager 5.62 ms,        asserts erased 5.16 ms
aot_eager costs 1.0 ms (EP=8) to 1.3 ms (EP=64) more than eager, and the asserts are 0.5-0.7 ms of that. The rest
is the compiled graph's other host work, at EP=8 as at EP=64.
"""
import statistics, time, sys
import torch
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group
from relay_compile.reference import a2a_moe
from torch._dynamo.backends.common import aot_autograd
from functorch.compile import make_boxed_func
torch.set_num_threads(1)
ep = int(sys.argv[1]) if len(sys.argv) > 1 else 64
cfg = QWEN3_30B.with_(device="cpu", dtype="fp32", ep=ep, tokens=512, hidden=16, ffn=8)
group = standin_group(ep)
inp = make_inputs(cfg)

def strip_asserts(gm):
    n = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and "assert" in str(node.target) and not node.users:
            gm.graph.erase_node(node); n += 1
    gm.graph.eliminate_dead_code(); gm.recompile(); return n

def make(strip):
    def fw(g, _):
        if strip: print("stripped", strip_asserts(g), file=sys.stderr)
        return make_boxed_func(g.forward)
    aot = aot_autograd(fw_compiler=fw, bw_compiler=fw)
    def fn(x, ids, scores, w1, w2, w3):
        return a2a_moe(x, ids, scores, w1, w2, w3, group=group.group_name, use_grouped_mm=False)
    c = torch.compile(fn, backend=aot, fullgraph=True, dynamic=False)
    def run(*a):
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            return c(*a)
    return run

rows = {"eager": lambda *a: a2a_moe(*a, group=group.group_name, use_grouped_mm=False), "aot_eager": make(False), "aot_eager stripped": make(True)}
def step(fn):
    inp.clear_grads()
    fn(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights).backward(inp.grad_y_TH)
for f in rows.values(): step(f); step(f)
times = {k: [] for k in rows}
for _ in range(15):
    for k, f in rows.items():
        t = time.perf_counter(); step(f); times[k].append(time.perf_counter() - t)
for k, v in times.items(): print(f"{k:22s} {1e3*statistics.median(v):8.2f} ms")

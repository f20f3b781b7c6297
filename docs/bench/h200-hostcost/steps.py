"""EP=64 ring_moe steps (H200, Qwen3 layer, defaults): median host time of the calls and wall time per step."""
import time, torch, statistics
from relay_compile import ring_moe
from relay_compile.bench.configs import QWEN3_30B
from relay_compile.bench.inputs import make_inputs
from relay_compile.bench.standin_group import standin_group
cfg = QWEN3_30B.with_(device="cuda", dtype="bf16", ep=64, tokens=65536)
group = standin_group(64); inp = make_inputs(cfg)
def step():
    inp.clear_grads(); torch.cuda.synchronize(); t0 = time.perf_counter()
    y = ring_moe(inp.x_TH, inp.topk_ids_TK, inp.topk_scores_TK, *inp.weights, group=group)
    y.backward(inp.grad_y_TH); t1 = time.perf_counter(); torch.cuda.synchronize()
    return (t1 - t0) * 1e3, (time.perf_counter() - t0) * 1e3
for _ in range(3): step()
r = [step() for _ in range(60)]
print("host ms %.1f wall ms %.1f" % (statistics.median(a for a, b in r), statistics.median(b for a, b in r)))

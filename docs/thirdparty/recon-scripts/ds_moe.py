"""Recon: DeepSpeed 0.19.8 deepspeed.moe.layer.MoE under backend="relaymoe", 2 gloo CPU ranks.

usage: python ds_moe.py --k 2 --drop-tokens 1 [--no-sampling] [--mode explain|compile|both] [--tag NAME]
         [--dynamo KEY=VAL ...]
"""
import argparse
import datetime
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

OUT = "/tmp/recon26"


def run(rank, world, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=15))
    import deepspeed
    from deepspeed.moe.layer import MoE
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=15))
    import relay_compile
    from relay_compile import backend as rb

    for kv in args.dynamo or []:
        k, v = kv.split("=")
        setattr(torch._dynamo.config, k, eval(v))

    H, F, E = 16, 32, 4
    torch.manual_seed(0)  # same weights on both ranks (router replicated)
    expert = nn.Sequential(nn.Linear(H, F), nn.GELU(), nn.Linear(F, H))
    layer = MoE(H, expert=expert, num_experts=E, ep_size=world, k=args.k, drop_tokens=bool(args.drop_tokens),
                top2_2nd_expert_sampling=not args.no_sampling,
                use_rts=not args.no_sampling)
    layer.set_deepspeed_parallelism()  # groups._create_expert_and_data_parallel(ep_size) + _set_ep_group
    torch.manual_seed(100 + rank)
    x = torch.randn(1, 8, H)
    if args.x_grad:
        x.requires_grad_(True)

    y, l_aux, counts = layer(x)
    y.sum().backward()
    print(f"[rank{rank}] eager ok: y {tuple(y.shape)} l_aux {float(l_aux):.4f} exp_counts {counts.tolist()}",
          flush=True)
    layer.zero_grad()
    result = {"tag": args.tag, "rank": rank}
    if args.mode in ("explain", "both"):
        torch._dynamo.reset()
        try:
            reps = relay_compile.explain(layer, x, dump_dir=f"{OUT}/dumps_{args.tag}_explain")
            result["explain"] = [json.loads(r.to_json()) for r in reps]
        except Exception as e:
            result["explain_error"] = "".join(traceback.format_exception(e))[-3000:]
        result["graph_breaks_explain"] = dict(torch._dynamo.utils.counters.get("graph_break", {}))
    if args.mode in ("compile", "both"):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        try:
            m = torch.compile(layer, backend="relaymoe", options={"dump_dir": f"{OUT}/dumps_{args.tag}"})
            yc, _, _ = m(x)
            yc.sum().backward()
            result["compile_ok"] = True
        except Exception as e:
            result["compile_error"] = "".join(traceback.format_exception(e))[-3000:]
        result["compiled_reports"] = [json.loads(r.to_json()) for r in rb.compiled_reports()]
        result["graph_breaks_compile"] = dict(torch._dynamo.utils.counters.get("graph_break", {}))
        result["unique_graphs"] = torch._dynamo.utils.counters["stats"].get("unique_graphs")
    if args.mode == "probe":
        sys.path.insert(0, OUT)
        import probe
        torch._dynamo.reset()
        torch.compile(layer, backend=probe.probe_backend)(x)
        result["probe"] = probe.LINES
        if rank == 0:
            print("\n".join(probe.LINES), flush=True)
    with open(f"{OUT}/result_{args.tag}_rank{rank}.json", "w") as f:
        json.dump(result, f, indent=1, default=str)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--drop-tokens", type=int, default=1)
    p.add_argument("--no-sampling", action="store_true")
    p.add_argument("--x-grad", action="store_true")
    p.add_argument("--mode", default="both")
    p.add_argument("--tag", default="ds")
    p.add_argument("--port", type=int, default=29561)
    p.add_argument("--dynamo", nargs="*")
    a = p.parse_args()
    mp.spawn(run, args=(2, a), nprocs=2, join=True)

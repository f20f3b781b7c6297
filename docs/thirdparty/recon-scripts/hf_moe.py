"""Recon: transformers 5.24.0 HF MoE blocks with expert parallelism (all_to_all) under backend="relaymoe".

usage: python hf_moe.py [--model qwen3_moe] [--impl grouped_mm] [--mode explain|compile|both|probe] [--tag NAME]
         [--dynamo KEY=VAL ...] [--no-x-grad]
"""
import argparse
import datetime
import importlib
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OUT = "/tmp/recon26"

MODELS = {  # model_type: (config module, config class, modeling module, block class)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock"),
    "mixtral": ("MixtralConfig", "MixtralSparseMoeBlock"),
    "olmoe": ("OlmoeConfig", "OlmoeSparseMoeBlock"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeSparseMoeBlock"),
}


def build(model_type, impl):
    cfg_name, block_name = MODELS[model_type]
    cfg_mod = importlib.import_module(f"transformers.models.{model_type}.configuration_{model_type}")
    mod = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    kw = dict(hidden_size=32, moe_intermediate_size=16, intermediate_size=16, num_experts=4, num_local_experts=4,
              num_experts_per_tok=2, shared_expert_intermediate_size=16)
    config = getattr(cfg_mod, cfg_name)(**kw)
    if impl != "none":
        config._experts_implementation = impl
    block = getattr(mod, block_name)(config)
    return config, block, getattr(type(config), "base_model_ep_plan", None)


def run(rank, world, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=15))
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import apply_expert_parallelism
    import relay_compile
    from relay_compile import backend as rb

    for kv in args.dynamo or []:
        k, v = kv.split("=")
        setattr(torch._dynamo.config, k, eval(v))

    if args.patch_branch:  # recon only: AllToAllEP.__call__ without its `if tokens.shape[0] == 0:` branch
        from transformers.distributed import expert_parallel as ep

        def _call_no_branch(self, hidden_states, top_k_index, top_k_weights):
            tokens, expert_ids, weights, state = self._dispatch_tokens(hidden_states, top_k_index, top_k_weights)
            return self._combine_tokens(self.experts_forward(tokens, expert_ids, weights), state)
        ep.AllToAllEP.__call__ = _call_no_branch
    if args.guard_or_false:  # recon only: the same branch written `if guard_or_false(tokens.shape[0] == 0):`
        from torch.fx.experimental.symbolic_shapes import guard_or_false
        from transformers.distributed import expert_parallel as ep

        def _call_guard_or_false(self, hidden_states, top_k_index, top_k_weights):
            tokens, expert_ids, weights, state = self._dispatch_tokens(hidden_states, top_k_index, top_k_weights)
            if guard_or_false(tokens.shape[0] == 0):
                expert_output = self.experts_forward(
                    tokens.sum(dim=0, keepdim=True), expert_ids.new_zeros((1, 1)), weights.new_ones((1, 1))
                )[:0]
            else:
                expert_output = self.experts_forward(tokens, expert_ids, weights)
            return self._combine_tokens(expert_output, state)
        ep.AllToAllEP.__call__ = _call_guard_or_false
    for kv in args.fxcfg or []:
        k, v = kv.split("=")
        import torch.fx.experimental._config as fxcfg
        setattr(fxcfg, k, eval(v))
    torch.manual_seed(0)  # same full weights on every rank; EP keeps this rank's shard
    config, block, model_plan = build(args.model, args.impl)
    for name, p in block.named_parameters():
        with torch.no_grad():
            p.normal_(0, 0.2)
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("ep", "tp"))
    ep_mesh, tp_mesh = mesh["ep"], mesh["tp"]
    # The model's plan names `layers.*.mlp.<...>`; relative to the block it is `<...>`.
    plan = {k.split("layers.*.mlp.", 1)[1]: v for k, v in (model_plan or {}).items() if "layers.*.mlp." in k}
    apply_expert_parallelism(block, ep_mesh, tp_mesh, plan, ep_implementation="all_to_all")
    torch.manual_seed(100 + rank)
    x = torch.randn(1, 8, 32, requires_grad=not args.no_x_grad)
    out = block(x)
    y = out[0] if isinstance(out, tuple) else out
    y.sum().backward()
    print(f"[rank{rank}] eager ok: plan {plan}; y {tuple(y.shape)} |y| {float(y.detach().abs().sum()):.4f}; "
          f"experts impl {getattr(config, '_experts_implementation', None)}", flush=True)
    result = {"tag": args.tag, "rank": rank, "plan": plan}
    if args.mode in ("explain", "both"):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        try:
            reps = relay_compile.explain(block, x, dump_dir=f"{OUT}/dumps_{args.tag}_explain")
            result["explain"] = [json.loads(r.to_json()) for r in reps]
        except Exception as e:
            result["explain_error"] = "".join(traceback.format_exception(e))[-3000:]
        result["graph_breaks_explain"] = dict(torch._dynamo.utils.counters.get("graph_break", {}))
    if args.mode in ("compile", "both"):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        try:
            m = torch.compile(block, backend="relaymoe", options={"dump_dir": f"{OUT}/dumps_{args.tag}"})
            out = m(x)
            yc = out[0] if isinstance(out, tuple) else out
            yc.sum().backward()
            result["compile_ok"] = True
            result["max_abs_diff_vs_eager"] = float((yc - y).abs().max())
        except Exception as e:
            result["compile_error"] = "".join(traceback.format_exception(e))[-3000:]
        result["compiled_reports"] = [json.loads(r.to_json()) for r in rb.compiled_reports()]
        result["graph_breaks_compile"] = dict(torch._dynamo.utils.counters.get("graph_break", {}))
        result["unique_graphs"] = torch._dynamo.utils.counters["stats"].get("unique_graphs")
    if args.mode == "probe":
        sys.path.insert(0, OUT)
        import importlib as _il
        probe = _il.import_module(args.probe_module)
        torch._dynamo.reset()
        torch.compile(block, backend=probe.probe_backend)(x)
        result["probe"] = probe.LINES
        if rank == 0:
            print("\n".join(probe.LINES), flush=True)
    with open(f"{OUT}/result_{args.tag}_rank{rank}.json", "w") as f:
        json.dump(result, f, indent=1, default=str)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3_moe")
    p.add_argument("--impl", default="grouped_mm")
    p.add_argument("--mode", default="both")
    p.add_argument("--tag", default="hf")
    p.add_argument("--port", type=int, default=29571)
    p.add_argument("--no-x-grad", action="store_true")
    p.add_argument("--patch-branch", action="store_true")
    p.add_argument("--guard-or-false", action="store_true")
    p.add_argument("--probe-module", default="probe")
    p.add_argument("--fxcfg", nargs="*")
    p.add_argument("--dynamo", nargs="*")
    a = p.parse_args()
    mp.spawn(run, args=(2, a), nprocs=2, join=True)

"""megatron-core resumes from a torch_dist/ view at a new topology: TP*PP*DP
processes (gloo, CPU) build the fixture's GPTModel, DDP and distributed
optimizer at TP / PP / DP (make_megatron.build, no step), then load as
Megatron-LM's load_checkpoint does: the content metadata from common.pt picks
the optimizer layout, dist_checkpointing.load reads the model's and the
DistributedOptimizer's sharded state dicts, model.load_state_dict and
optimizer.load_state_dict apply them. Each rank then dumps what mcore holds
(make_megatron.dump_reference: weights, fp32 masters and Adam moments of its
range) to OUT/reference/, takes one more optimizer step on seeded gradients
and rank 0 writes OUT/after.json (the iteration, the args' degrees, each
param group's step before and after, whether the step was finite).

    python megatron_torch_dist_resume.py TP PP DP PORT CKPT_ITER_DIR OUT [EP EXPERTS]

EP, EXPERTS: a MoE run's expert-parallel size and experts per layer.
"""
import argparse
import json
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures"))
import make_megatron as mk  # noqa: E402  the producer's model, config and CPU shims


def keep_torch_adam_step():
    """megatron-core 0.16 without Apex / Transformer Engine (CPU): its
    load_state_dict gives torch's Adam a per-parameter 'step' from the param
    groups, which load_parameter_state_from_fully_reshardable then asks the
    checkpoint's tensors for too (it skips 'step' among them): a KeyError with
    mcore's own checkpoints as with this one. With Transformer Engine's
    FusedAdam (a GPU run) there is no such key; here it is kept as
    load_state_dict set it."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as DO
    plain = DO._set_main_param_and_optimizer_states

    def keep_step(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        plain(self, model_param, tensors)
        if step is not None:
            state["step"] = step
    DO._set_main_param_and_optimizer_states = keep_step


def prepare_to_load(opt):
    """Megatron-LM's setup_model_and_optimizer initialises the optimizer's
    states before loading (init_state_fn). On CPU megatron-core runs torch's
    Adam (no Apex / Transformer Engine), whose state also holds a
    per-parameter step that DistributedOptimizer.state_dict reads: a fresh
    Adam's 0 (load_state_dict then sets the checkpoint's)."""
    import torch
    for sub in getattr(opt, "chained_optimizers", [opt]):
        sub.init_state_fn(sub.optimizer, sub.config)
        for st in sub.optimizer.state.values():
            st.setdefault("step", torch.tensor(0.0))
    keep_torch_adam_step()


def load_torch_dist(chunks, opt, ckpt):
    """Megatron-LM's load_checkpoint for torch_dist: the optimizer's layout
    from common.pt's content metadata, dist_checkpointing.load of the model's
    and the optimizer's sharded state dicts, then both load_state_dicts.
    Returns the content metadata and the loaded state."""
    from megatron.core import dist_checkpointing
    content = dist_checkpointing.load_content_metadata(ckpt)
    model_sd = chunks[0].sharded_state_dict()
    sd = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=True, metadata=content)}
    state = dist_checkpointing.load(sd, ckpt)
    chunks[0].load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    return content, state


def adam_steps(opt):
    return sorted({float(st["step"]) for sub in getattr(opt, "chained_optimizers", [opt])
                   for st in sub.optimizer.state.values() if "step" in st})


def worker(rank, o, port, ckpt):
    mk.cpu_only()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=o.tp * o.pp * o.dp)
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(o.tp, o.pp, expert_model_parallel_size=o.ep)
    torch.manual_seed(999)  # weights and states come from the checkpoint, not from here
    chunks, ddp, opt = mk.build(o, step=False)
    prepare_to_load(opt)
    content, state = load_torch_dist(chunks, opt, ckpt)
    mk.dump_reference(o, chunks, opt)
    steps_before = adam_steps(opt)
    update_ok, grad_norm, _ = mk.take_step(o, ddp, opt)
    steps_after = adam_steps(opt)
    finite = all(bool(torch.isfinite(p).all()) for m in chunks for p in m.parameters())
    if rank == 0:
        args = state.get("args")  # Megatron-Bridge and megatron-core alone save none
        with open(os.path.join(o.out, "after.json"), "w") as f:
            json.dump({"content_metadata": content, "iteration": state["iteration"],
                       "args_tp": args.tensor_model_parallel_size if args else None,
                       "args_pp": args.pipeline_model_parallel_size if args else None,
                       "steps_before": steps_before, "steps_after": steps_after, "update_ok": bool(update_ok),
                       "grad_norm": float(grad_norm), "finite": finite and math.isfinite(float(grad_norm))}, f)
    dist.barrier()
    dist.destroy_process_group()


def main():
    tp, pp, dp, port, ckpt, out = sys.argv[1:7]
    ep, experts = (int(sys.argv[7]), int(sys.argv[8])) if len(sys.argv) > 8 else (1, None)
    o = argparse.Namespace(mode="legacy", out=out, tp=int(tp), pp=int(pp), dp=int(dp), vp=None, dist_opt=True,
                           bf16=True, arch="gpt", experts=experts, ep=ep, bucket_size=None)
    os.makedirs(out, exist_ok=True)
    mk.preload_megatron()
    mp.start_processes(worker, args=(o, int(port), ckpt), nprocs=o.tp * o.pp * o.dp, start_method="fork")


if __name__ == "__main__":
    main()

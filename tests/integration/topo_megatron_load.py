"""megatron-core loads a topo/ Megatron-native view: WORLD processes (gloo,
CPU) build a GPTModel at TP=WORLD/EP, PP=1, expert parallelism EP (MoE
checkpoints: args.num_experts) with the fixture's config, load
VIEW/iter_*/mp_rank_<t>[_<e>]/model_optim_rng.pt with strict=True, run one
forward with parallel_output=False and rank 0 saves the logits to OUT.

    python topo_megatron_load.py WORLD PORT VIEW OUT [EP]
"""
import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import make_megatron as mk  # tests/fixtures: the producer's config and CPU shims


def worker(rank, world, port, view, out, ep):
    mk.cpu_only()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.tensor_parallel import random as tp_random
    tp = world // ep
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    # The attention's dropout RNG fork needs CUDA; dropout is 0 here.
    tp_random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    it = open(os.path.join(view, "latest_checkpointed_iteration.txt")).read().strip()
    rank_dir = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    if ep > 1:
        rank_dir += f"_{ps.get_expert_model_parallel_rank():03d}"
    sd = torch.load(os.path.join(view, f"iter_{int(it):07d}", rank_dir, "model_optim_rng.pt"), weights_only=False)
    args = sd["args"]
    assert args.tensor_model_parallel_size == tp and args.pipeline_model_parallel_size == 1
    assert args.expert_model_parallel_size == ep
    experts = getattr(args, "num_experts", None)
    moe = dict(num_moe_experts=experts, expert_model_parallel_size=ep, moe_router_topk=args.moe_router_topk,
               moe_grouped_gemm=False) if experts else {}
    cfg = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, ffn_hidden_size=args.ffn_hidden_size, gated_linear_unit=args.swiglu,
        add_bias_linear=args.add_bias_linear, use_cpu_initialization=True, params_dtype=torch.float32,
        tensor_model_parallel_size=tp, hidden_dropout=0.0, attention_dropout=0.0, **moe)
    vocab = sd["model"]["embedding.word_embeddings.weight"].shape[0] * tp
    torch.manual_seed(999)  # weights come from the checkpoint, not from here
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False), vocab_size=vocab,
                     max_sequence_length=args.max_position_embeddings, share_embeddings_and_output_weights=False,
                     parallel_output=False)
    missing, unexpected = model.load_state_dict(sd["model"], strict=True)
    assert not missing and not unexpected
    model.eval()
    s = args.max_position_embeddings
    tokens = torch.arange(2 * s).reshape(2, s) % min(vocab, 50)
    pos = torch.arange(s).unsqueeze(0).expand(2, s)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        logits = model(tokens, pos, mask)
    if rank == 0:
        torch.save(logits.float().contiguous(), out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    world, port, view, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    ep = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    mk.preload_megatron()  # imported once; the forked ranks have it
    mp.start_processes(worker, args=(world, port, view, out, ep), nprocs=world, join=True, start_method="fork")

"""megatron-core loads a topo/ Megatron-native view: WORLD processes (gloo,
CPU) build a GPTModel at TP=WORLD, PP=1 with the fixture's config, load
VIEW/iter_*/mp_rank_<t>/model_optim_rng.pt with strict=True, run one forward
with parallel_output=False and rank 0 saves the logits to OUT.

    python topo_megatron_load.py WORLD PORT VIEW OUT
"""
import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import make_megatron as mk  # tests/fixtures: the producer's config and CPU shims


def worker(rank, world, port, view, out):
    mk.cpu_only()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.tensor_parallel import random as tp_random
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    # The attention's dropout RNG fork needs CUDA; dropout is 0 here.
    tp_random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    it = open(os.path.join(view, "latest_checkpointed_iteration.txt")).read().strip()
    sd = torch.load(os.path.join(view, f"iter_{int(it):07d}", f"mp_rank_{rank:02d}", "model_optim_rng.pt"),
                    weights_only=False)
    args = sd["args"]
    assert args.tensor_model_parallel_size == world and args.pipeline_model_parallel_size == 1
    cfg = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, ffn_hidden_size=args.ffn_hidden_size, gated_linear_unit=args.swiglu,
        add_bias_linear=args.add_bias_linear, use_cpu_initialization=True, params_dtype=torch.float32,
        tensor_model_parallel_size=world, hidden_dropout=0.0, attention_dropout=0.0)
    vocab = sd["model"]["embedding.word_embeddings.weight"].shape[0] * world
    torch.manual_seed(999)  # weights come from the checkpoint, not from here
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
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
    mp.spawn(worker, args=(world, port, view, out), nprocs=world, join=True)

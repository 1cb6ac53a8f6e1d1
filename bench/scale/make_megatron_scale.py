"""Writes a Megatron-core `torch_dist` checkpoint with ~100k tiny ShardedTensors
(issue 18, performance at scale). Not part of CI.

The sharded state dict is built directly from `ShardedTensor.from_rank_offsets`
objects with the keys, shardings and replica ids that megatron-core's GPTModel
(local layer spec, LayerNorm, GELU MLP with biases, untied embeddings) gives
them, and saved by megatron-core's own `dist_checkpointing.save(sd, dir)` with
its default strategies: `torch_dist` for the ShardedTensors (`.metadata`,
`__<rank>_<i>.distcp`), the common strategy for the rest (`common.pt`: args,
iteration, checkpoint_version) and `metadata.json`. One process per rank
(torch.multiprocessing spawn, gloo, CPU); all ranks are one TP group (TP =
--ranks, PP = DP = 1), as `parallel_state` would set them up.

Per rank, like mcore:
  TP-sharded  linear_qkv / linear_fc1 weight+bias along dim 0, linear_proj /
              linear_fc2 weight along dim 1, word embeddings and output layer
              along the vocab axis; replica_id (0, 0, 0)
  replicated  layer norms, linear_proj / linear_fc2 biases, position
              embeddings; replica_id (0, tp_rank, 0): every rank passes its copy,
              only TP rank 0's is written
--layout flat (default): one key per layer and parameter,
`decoder.layers.<i>.<param>` (no stack axis): ~--tensors keys in `.metadata`,
each in at most --ranks chunks; ckptfs serves params/decoder.layers.<i>.<param>/.
--layout stacked (what mcore's TransformerBlock itself does): one key per layer
parameter, `decoder.layers.<param>`, global shape [L, ...]; each layer is its
own ShardedTensor with prepend_axis_num=1 and offset (0, i, L). ckptfs serves
them per layer as params/decoder.layers.<i>.<param>/ and the whole stack as
other/decoder.layers.<param>.npy. Only for small counts: mcore's save turns
each key into a torch ShardedTensor, whose overlap check
(torch/distributed/_shard/sharding_spec/_internals.py, _find_nd_overlapping_shards)
grows faster than linearly in the chunks of one key (2,000 tensors = 166
layers: 550k pair checks, 2.3 s of the 27 s save on rank 0), so thousands of
layers in one stack do not finish in minutes.

--tensors N is the number of logical model tensors (params/ entries): 12 per
layer plus 5 outside the layers, so L = (N - 5) // 12 layers. Shapes are tiny
(hidden = ranks, kv_channels 1, a handful of elements per shard). Every logical
tensor's full value is drawn from its own seeded generator (seed = the
tensor's index in a fixed order), and each rank cuts its shard from it, so the
reference can be recomputed without the checkpoint.

--ref REF.npz: keys are paths relative to the ckptfs mount root
(params/<fqn>/param.npy, and for --layout stacked one whole stack
other/decoder.layers.input_layernorm.weight.npy), values the exact full tensors
of ~20 sampled tensors.

    python bench/scale/make_megatron_scale.py OUT [--tensors 100000] [--ranks 4]
        [--layout flat|stacked] [--bf16] [--ref REF.npz]

Writes OUT/iter_0000007/ and OUT/latest_checkpointed_iteration.txt; prints the
generation time. Written against torch 2.15 (CPU) and megatron-core 0.16.1.
Check a mount against the reference with bench/scale/check_ref.py MOUNT REF.npz.

Measured 2026-11-25 on 2 shared cores (load 10-16 from other jobs), flat, 4 ranks:
  --tensors 2000    1,997 tensors, 9.7 MB, 137 s (mostly 4 x importing mcore;
                    save 31 s on rank 0); ckptfs index 1.9 s, mount 0.24 s,
                    ls -lR 3.6 s
  --tensors 20000   19,997 tensors, 97 MB, 146 s (save 68 s); ckptfs index 11 s
                    (0.86 GB), mount 4.7 s, ls -lR 22 s; 20/20 equal
  --tensors 100000  99,989 tensors (8,332 layers), 486 MB (.metadata 92 MB,
                    8 .distcp: 39-79 MB), 398 s (save 273 s on rank 0), peak RSS
                    2.3 GB per process
  ckptfs (/work/main/build/ckptfs: b1e5c8e plus uncommitted work on the
  pickle VM, rebuilt at 10:55 and 11:00 while this ran) on the 100k checkpoint:
  `index` 55-100 s wall (22-33 s user; 250k fragments; the 10:40 build traced
  unpickling .metadata alone at 38 s and 4.9 GB), peak RSS 4.2-5.5 GB, index
  43 MB; `info` 4.5 s; `mount` with that index 193-277 s (112 s CPU in both
  builds: the hf/ safetensors header is an nlohmann::ordered_json whose
  contains()/operator[] search linearly, so building it is quadratic in the
  tensor count); `ls -lR` of the mount (700k lines) 112-175 s; daemon VmHWM
  750 MB; all 20 reference tensors equal.
"""
import argparse
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures"))
from ports import free_port  # noqa: E402

ITERATION = 7
# Per-layer parameters of mcore's local-spec GPT layer: (name, global shape as a
# function of R = TP size, TP axis or None for replicated). hidden = R (heads =
# query groups = R, kv_channels = 1), ffn = 2R.
LAYER_PARAMS = [
    ("input_layernorm.weight", lambda r: (r,), None),
    ("input_layernorm.bias", lambda r: (r,), None),
    ("self_attention.linear_qkv.weight", lambda r: (3 * r, r), 0),
    ("self_attention.linear_qkv.bias", lambda r: (3 * r,), 0),
    ("self_attention.linear_proj.weight", lambda r: (r, r), 1),
    ("self_attention.linear_proj.bias", lambda r: (r,), None),
    ("pre_mlp_layernorm.weight", lambda r: (r,), None),
    ("pre_mlp_layernorm.bias", lambda r: (r,), None),
    ("mlp.linear_fc1.weight", lambda r: (2 * r, r), 0),
    ("mlp.linear_fc1.bias", lambda r: (2 * r,), 0),
    ("mlp.linear_fc2.weight", lambda r: (r, 2 * r), 1),
    ("mlp.linear_fc2.bias", lambda r: (r,), None),
]
SEQ = 16
OUTSIDE = [  # (key, shape, TP axis): before and after the layers
    ("embedding.word_embeddings.weight", lambda r: (8 * r, r), 0),
    ("embedding.position_embeddings.weight", lambda r: (SEQ, r), None),
    ("decoder.final_layernorm.weight", lambda r: (r,), None),
    ("decoder.final_layernorm.bias", lambda r: (r,), None),
    ("output_layer.weight", lambda r: (8 * r, r), 0),
]


def layers_for(n):
    return max(1, (n - len(OUTSIDE)) // len(LAYER_PARAMS))


def full_value(index, shape, bf16):
    """The full tensor of the index-th logical tensor (fixed order: OUTSIDE, then
    layer by layer). Values are exact in bf16 when --bf16 (rounded once here)."""
    g = torch.Generator().manual_seed(1000003 + index)
    t = torch.randn(shape, generator=g)
    return t.to(torch.bfloat16) if bf16 else t


def tensor_index(layer, p):
    """Index of LAYER_PARAMS[p] in layer `layer` (None for OUTSIDE[p])."""
    return p if layer is None else len(OUTSIDE) + layer * len(LAYER_PARAMS) + p


def shard(full, axis, rank, ranks):
    if axis is None:
        return full.clone()
    n = full.shape[axis] // ranks
    return full.narrow(axis, rank * n, n).clone()


def megatron_args(o, layers):
    r = o.ranks
    return argparse.Namespace(
        num_layers=layers, hidden_size=r, num_attention_heads=r, num_query_groups=r, group_query_attention=False,
        ffn_hidden_size=2 * r, swiglu=False, kv_channels=1, max_position_embeddings=SEQ,
        position_embedding_type="learned_absolute", add_bias_linear=True, untie_embeddings_and_output_weights=True,
        vocab_size=8 * r, padded_vocab_size=8 * r, make_vocab_size_divisible_by=8, tensor_model_parallel_size=r,
        pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None, data_parallel_size=1,
        world_size=r, use_distributed_optimizer=False, bf16=o.bf16, fp16=False,
        params_dtype=torch.bfloat16 if o.bf16 else torch.float32, iteration=ITERATION, ckpt_format="torch_dist",
        transformer_impl="local", normalization="LayerNorm", seed=1234)


def sharded_state_dict(o, rank, layers):
    from megatron.core.dist_checkpointing import ShardedTensor
    r = o.ranks
    model = {}

    def make(key, full, axis, prepend=()):
        # mcore's make_tp_sharded_tensor_for_checkpoint / make_sharded_tensor_for_checkpoint:
        # replica_id (PP-independent 0, TP rank for replicated tensors, DP rank).
        local = shard(full, axis, rank, r)
        offsets = list(prepend)
        if axis is not None:
            offsets.append((axis + len(prepend), rank, r))
        replica = (0, 0, 0) if axis is not None else (0, rank, 0)
        return ShardedTensor.from_rank_offsets(key, local, *offsets, replica_id=replica, prepend_axis_num=len(prepend))

    for p, (key, shape, axis) in enumerate(OUTSIDE[:2]):
        model[key] = make(key, full_value(tensor_index(None, p), shape(r), o.bf16), axis)
    for i in range(layers):
        for p, (name, shape, axis) in enumerate(LAYER_PARAMS):
            full = full_value(tensor_index(i, p), shape(r), o.bf16)
            local_key = f"decoder.layers.{i}.{name}"
            if o.layout == "stacked":
                model[local_key] = make(f"decoder.layers.{name}", full, axis, prepend=[(0, i, layers)])
            else:
                model[local_key] = make(local_key, full, axis)
    for p, (key, shape, axis) in list(enumerate(OUTSIDE))[2:]:
        model[key] = make(key, full_value(tensor_index(None, p), shape(r), o.bf16), axis)
    return {"model": model, "args": megatron_args(o, layers), "checkpoint_version": 3.0, "iteration": ITERATION}


def cpu_only():
    """mcore's save path calls torch.cuda.synchronize (filesystem_async.py's
    preload); on this CPU-only producer it is a no-op (as in
    tests/fixtures/make_megatron.py)."""
    warnings.filterwarnings("ignore")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.is_available = lambda: False


def worker(rank, o, port, layers):
    cpu_only()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=o.ranks)
    from megatron.core import dist_checkpointing, parallel_state as ps
    ps.initialize_model_parallel(o.ranks, 1)
    t0 = time.monotonic()
    sd = sharded_state_dict(o, rank, layers)
    t1 = time.monotonic()
    d = os.path.join(o.out, f"iter_{ITERATION:07d}")
    os.makedirs(d, exist_ok=True)
    dist_checkpointing.save(sd, d)  # default: torch_dist + the common strategy (common.pt, metadata.json)
    dist.barrier()
    if rank == 0:
        with open(os.path.join(o.out, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
        print(f"rank 0: built {len(sd['model'])} ShardedTensors in {t1 - t0:.1f} s, "
              f"dist_checkpointing.save {time.monotonic() - t1:.1f} s", flush=True)
    dist.destroy_process_group()


def reference(o, layers):
    """~20 sampled logical tensors at their mount paths, recomputed from the seeds."""
    import numpy as np
    r = o.ranks

    def np_of(t):
        return t.float().numpy()

    ref = {}
    for p in range(len(OUTSIDE)):
        key, shape, _ = OUTSIDE[p]
        if p in (0, 2, 4):
            ref[f"params/{key}/param.npy"] = np_of(full_value(tensor_index(None, p), shape(r), o.bf16))
    g = torch.Generator().manual_seed(42)
    picks = {(0, 2), (layers - 1, 10), (layers // 2, 4)}
    while len(picks) < min(17, layers * len(LAYER_PARAMS)):
        picks.add((int(torch.randint(layers, (1,), generator=g)), int(torch.randint(len(LAYER_PARAMS), (1,), generator=g))))
    for i, p in sorted(picks):
        name, shape, _ = LAYER_PARAMS[p]
        ref[f"params/decoder.layers.{i}.{name}/param.npy"] = np_of(full_value(tensor_index(i, p), shape(r), o.bf16))
    if o.layout == "stacked":  # one whole stack, as other/ serves it
        name, shape, _ = LAYER_PARAMS[0]
        ref[f"other/decoder.layers.{name}.npy"] = np.stack(
            [np_of(full_value(tensor_index(i, 0), shape(r), o.bf16)) for i in range(layers)])
    return ref


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--tensors", type=int, default=100000, help="logical model tensors (12 per layer + 5)")
    ap.add_argument("--ranks", type=int, default=4, help="ranks = TP size (one process each)")
    ap.add_argument("--layout", choices=["flat", "stacked"], default="flat")
    ap.add_argument("--bf16", action="store_true", help="bf16 tensors (default float32)")
    ap.add_argument("--ref", default=None, help="write the reference sample npz here")
    o = ap.parse_args()
    layers = layers_for(o.tensors)
    os.makedirs(o.out, exist_ok=True)
    port = free_port()
    t0 = time.monotonic()
    mp.spawn(worker, args=(o, port, layers), nprocs=o.ranks, join=True)
    took = time.monotonic() - t0
    n = layers * len(LAYER_PARAMS) + len(OUTSIDE)
    size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(o.out) for f in fs)
    print(json.dumps({"tensors": n, "layers": layers, "ranks": o.ranks, "layout": o.layout,
                      "generation_s": round(took, 1), "bytes": size}), flush=True)
    if o.ref:
        import numpy as np
        ref = reference(o, layers)
        np.savez(o.ref, **ref)
        print(f"reference: {len(ref)} tensors -> {o.ref}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

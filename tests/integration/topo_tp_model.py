"""A small Llama-style model (vocab-parallel embedding, SwiGLU MLPs with
column-parallel w1/w3 and row-parallel w2, RMSNorms, column-parallel output),
for the topo/ test:

    python topo_tp_model.py 1 PORT save CKPT     dcp.save of the seeded model
    python topo_tp_model.py 1 PORT full HF OUT   logits of the unsharded model loaded from hf/ (load_file)
    python topo_tp_model.py 2 PORT tp VIEW OUT   logits of the same model split TP=2 by hand (gloo, CPU):
                                                 rank r reads only VIEW/tp<r>-pp0.safetensors
"""
import glob
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

V, D, FF, LAYERS, B, S = 16, 8, 12, 2, 2, 5


def params():
    g = torch.Generator().manual_seed(11)
    p = {"tok_embeddings.weight": torch.randn(V, D, generator=g)}
    for i in range(LAYERS):
        p[f"layers.{i}.ffn_norm.weight"] = 1 + 0.1 * torch.randn(D, generator=g)
        p[f"layers.{i}.feed_forward.w1.weight"] = torch.randn(FF, D, generator=g) / 3
        p[f"layers.{i}.feed_forward.w3.weight"] = torch.randn(FF, D, generator=g) / 3
        p[f"layers.{i}.feed_forward.w2.weight"] = torch.randn(D, FF, generator=g) / 3
    p["norm.weight"] = 1 + 0.1 * torch.randn(D, generator=g)
    p["output.weight"] = torch.randn(V, D, generator=g)
    return p


def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def tokens():
    return torch.arange(B * S).reshape(B, S) * 7 % V


def forward(p, embed, reduce, gather):
    h = embed(tokens())
    for i in range(LAYERS):
        x = rms(h, p[f"layers.{i}.ffn_norm.weight"])
        ff = f"layers.{i}.feed_forward."
        h = h + reduce((F.silu(x @ p[ff + "w1.weight"].T) * (x @ p[ff + "w3.weight"].T)) @ p[ff + "w2.weight"].T)
    return gather(rms(h, p["norm.weight"]) @ p["output.weight"].T)


def tp_worker(rank, world, port, view, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from safetensors import safe_open
    with safe_open(os.path.join(view, f"tp{rank}-pp0.safetensors"), framework="pt") as f:
        assert f.metadata()["tp_size"] == str(world)
        p = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("optimizer.")}
    emb = p["tok_embeddings.weight"]
    lo, n = rank * emb.shape[0], emb.shape[0]
    assert p["layers.0.feed_forward.w1.weight"].shape == (FF // world, D)
    assert p["layers.0.feed_forward.w2.weight"].shape == (D, FF // world)

    def embed(t):  # vocab-parallel: each rank looks up its rows, zeros elsewhere, all-reduce
        mask = (t >= lo) & (t < lo + n)
        e = emb[(t - lo).clamp(0, n - 1)] * mask.unsqueeze(-1)
        dist.all_reduce(e)
        return e

    def reduce(y):
        dist.all_reduce(y)
        return y

    def gather(y):
        parts = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(parts, y.contiguous())
        return torch.cat(parts, -1)
    logits = forward(p, embed, reduce, gather)
    if rank == 0:
        torch.save(logits, out)
    dist.barrier()
    dist.destroy_process_group()


def main():
    world, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    if mode == "save":
        import torch.distributed.checkpoint as dcp
        dcp.save({"model": params()}, checkpoint_id=sys.argv[4])
    elif mode == "full":
        from safetensors.torch import load_file
        p = {}
        for f in sorted(glob.glob(os.path.join(sys.argv[4], "model-*.safetensors"))):
            p.update(load_file(f))
        assert sorted(p) == sorted(params()) and all(torch.equal(p[k], v) for k, v in params().items())
        torch.save(forward(p, lambda t: p["tok_embeddings.weight"][t], lambda y: y, lambda y: y), sys.argv[5])
    else:
        mp.spawn(tp_worker, args=(world, port, sys.argv[4], sys.argv[5]), nprocs=world, join=True)


if __name__ == "__main__":
    main()

"""Writes the benchmark checkpoint with torch.distributed.checkpoint: 4 gloo ranks,
DTensor params sharded on dim 1 (column blocks, like TP), plus many small tensors
so that index-build throughput (fragments/s) is measured on a realistic count.

    python make_big_dcp.py OUT [--gib 2.0] [--small 2000]
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures"))
from ports import free_port  # noqa: E402


def run(rank, world, out, port, n_big, rows, cols, n_small):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(n_big):
        full = torch.empty(rows, cols).uniform_(-1, 1, generator=g)
        sd[f"model.layers.{i}.w"] = distribute_tensor(full, mesh, [Shard(1)])
        del full
    for i in range(n_small):
        sd[f"model.small.{i}.b"] = distribute_tensor(torch.randn(64, 12, generator=g), mesh, [Shard(1)])
    dcp.save(sd, checkpoint_id=out)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--small", type=int, default=2000)
    a = ap.parse_args()
    rows, cols = 4096, 8192  # 128 MiB per f32 tensor
    n_big = max(1, int(round(a.gib * 1024 / 128)))
    os.makedirs(a.out, exist_ok=True)
    port = free_port()
    mp.spawn(run, args=(4, a.out, port, n_big, rows, cols, a.small), nprocs=4, join=True)


if __name__ == "__main__":
    main()

"""Device-resident loads on a real GPU (bench/gpu_check.sh runs this there).

Writes a bf16 checkpoint with torch.distributed.checkpoint (4 gloo ranks, every
weight a DTensor sharded on dim 0, as FSDP2 saves it, ~1 GiB), then:

* correctness: every tensor read into CUDA memory by ckptfs.torch.read(device=)
  (its own dtype, widened to float32, and each of 4 Shard(1) column boxes, a
  TP=4 layout the source never had) equals the host read; torch's dcp.load
  through ckptfs.torch.StorageReader into CUDA float32 tensors equals it too;
* speed: the TP=4 Shard(1) load widened to float32 of every weight, into GPU
  memory, three ways, page cache warm, best of 3:
    device  ckptfs.torch.read(..., device="cuda"): spans staged, merged and
            widened on the GPU into the destination;
    pinned  the host path into pinned memory, then .cuda(non_blocking=True);
    host    the host path into pageable memory, then .cuda();
  printed as GB/s of float32 output and device/host ratios;
* idle release: the device backend's held bytes right after, and 2.5 s later.

    python bench/gpu_device_read.py WORKDIR [--gib 1.0] [--json OUT.json]
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures"))
from ports import free_port  # noqa: E402

import ckptfs  # noqa: E402
import ckptfs.torch as ckt  # noqa: E402

TP = 4


def _save(rank, world, out, port, n_big, rows, cols):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(n_big):
        full = torch.empty(rows, cols).uniform_(-1, 1, generator=g).to(torch.bfloat16)
        sd[f"layers.{i}.w"] = distribute_tensor(full, mesh, [Shard(0)])
    for i in range(16):  # small tensors: norms and biases
        sd[f"layers.{i}.norm"] = distribute_tensor(torch.randn(cols, generator=g).to(torch.bfloat16), mesh, [Shard(0)])
    dcp.save(sd, checkpoint_id=out)
    dist.barrier()
    dist.destroy_process_group()


def write_checkpoint(path, gib):
    rows, cols = 8192, 4096
    n_big = max(1, int(gib * (1 << 30) / (rows * cols * 2)))
    if not os.path.exists(os.path.join(path, ".metadata")):
        mp.spawn(_save, args=(4, path, free_port(), n_big, rows, cols), nprocs=4, join=True)
    return n_big, rows, cols


def col_boxes(shape):
    c = shape[1]
    return [(slice(None), slice(r * c // TP, (r + 1) * c // TP)) for r in range(TP)]


def check(ck, dev, index):
    n = 0
    for t in ck.tensors():
        host = ckt.read(ck, t.name, t.state)
        got = ckt.read(ck, t.name, t.state, device=dev)
        assert got.device.type == "cuda" and torch.equal(got.cpu(), host), t.name
        wide = ckt.read(ck, t.name, t.state, dtype="float32", device=dev)
        assert torch.equal(wide.cpu(), host.float()), t.name
        n += 2
        if len(t.shape) == 2:
            for box in col_boxes(t.shape):
                g = ckt.read(ck, t.name, t.state, box=box, dtype="float32", device=dev)
                assert torch.equal(g.cpu(), host[box].float()), (t.name, box)
                n += 1
    # torch's own dcp.load through the StorageReader into CUDA float32 tensors.
    sd = {t.name: torch.zeros(t.shape, dtype=torch.float32, device=dev) for t in ck.tensors()}
    dcp.load(sd, storage_reader=ckt.StorageReader(ck.src, index=index, gpu="off"), no_dist=True)
    for t in ck.tensors():
        assert torch.equal(sd[t.name].cpu(), ckt.read(ck, t.name, t.state).float()), t.name
        n += 1
    return n


def tp_load(ck, names, how, dev):
    """Every weight's 4 column boxes widened to float32, in GPU memory."""
    out = []
    for name, shape in names:
        for box in col_boxes(shape):
            if how == "device":
                out.append(ckt.read(ck, name, box=box, dtype="float32", device=dev))
            elif how == "pinned":
                out.append(ckt.read(ck, name, box=box, dtype="float32", pin_memory=True).to(dev, non_blocking=True))
            else:
                out.append(ckt.read(ck, name, box=box, dtype="float32").to(dev))
    torch.cuda.synchronize(dev)
    return sum(o.numel() * 4 for o in out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("work")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--json")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    src = os.path.join(a.work, "bf16_fsdp_w4")
    t0 = time.time()
    n_big, rows, cols = write_checkpoint(src, a.gib)
    index = os.path.join(a.work, "index")
    ck = ckptfs.open(src, index, gpu="off")
    dev = torch.device("cuda", 0)
    res = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "checkpoint": f"{n_big} x [{rows}, {cols}] bf16 + 16 norms, 4 ranks Shard(0)",
           "write_s": round(time.time() - t0, 1), "backend": ck.device_info(0)}
    print(f"device backend: {res['backend']}", flush=True)
    assert res["backend"]["kernels_trusted"], res["backend"]
    res["checked_reads"] = check(ck, dev, index)
    print(f"correctness: {res['checked_reads']} device reads equal the host path", flush=True)

    names = [(t.name, t.shape) for t in ck.tensors() if len(t.shape) == 2]
    for _ in range(2):  # page cache warm for every path
        tp_load(ck, names, "host", dev)
    times = {}
    for how in ("device", "pinned", "host"):
        best = 1e30
        for _ in range(3):
            torch.cuda.empty_cache()
            t1 = time.perf_counter()
            nbytes = tp_load(ck, names, how, dev)
            best = min(best, time.perf_counter() - t1)
        times[how] = best
        print(f"TP={TP} Shard(1) load widened to float32, {how:>6}: {nbytes / best / 1e9:6.2f} GB/s "
              f"({best:.3f} s for {nbytes / 2**30:.2f} GiB)", flush=True)
    res["tp4_shard1_widen"] = {h: {"seconds": round(t, 4), "gbps": round(nbytes / t / 1e9, 2)} for h, t in times.items()}
    res["device_over_pinned"] = round(times["pinned"] / times["device"], 2)
    res["device_over_host"] = round(times["host"] / times["device"], 2)
    print(f"device path speedup: {res['device_over_pinned']}x over pinned host + .cuda(), "
          f"{res['device_over_host']}x over pageable host + .cuda()", flush=True)
    held = ck.device_info(0)["held_bytes"]
    time.sleep(2.5)
    idle = ck.device_info(0)["held_bytes"]
    res["held_bytes_after_reads"], res["held_bytes_2_5s_later"] = held, idle
    print(f"device backend held {held} bytes after the reads, {idle} 2.5 s later", flush=True)
    st = ck.stats()
    res["gpu_fallbacks"] = st.get("gpu_fallbacks")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    ok = idle == 0 and times["device"] < times["pinned"] and not res["gpu_fallbacks"]
    print("OK" if ok else "TARGET MISSED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

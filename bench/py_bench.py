"""The Python package against the mount, torch's own DCP reader and plain pread,
on the 2 GiB DCP benchmark checkpoint (4 ranks; 16 float32 [4096, 8192]
tensors sharded on dim 1, 2000 small ones), sources cold (page cache dropped)
and warm, all in one run:

  * a rank's resharded slice, TP=4 rank 1 (columns 2048..4095 of every big
    tensor = source rank 1's blocks): Checkpoint.read of each box into one
    reused numpy buffer, vs the mount's topo/tp4-pp1/tp1-pp0.safetensors read
    whole (1 MiB reads), vs dcp.load of DTensor(Shard(1)) shards as rank 1 of
    4 (a fake process group: only this rank's boxes are planned and read)
    through ckptfs.torch.StorageReader and through torch's FileSystemReader of
    this very checkpoint, vs plain 4 MiB preads of source rank 1's file (the
    same bytes; 32 MiB preads, the box's size, shown too);
  * the whole checkpoint at world 1: dcp.load with ckptfs.torch.StorageReader
    vs dcp.load with torch's FileSystemReader (the native reader of this very
    checkpoint), both into preallocated tensors, vs preads of every shard;
  * threads: the four row quarters of every big tensor read by 1 and by 2
    Python threads (the GIL is released in the core), sources warm.

    python bench/py_bench.py [--ckpt DIR] [--gib 2.0] [--bin build/ckptfs]
"""
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dcp_bench import bench_checkpoint, drop_cache  # noqa: E402

def pread_files(paths, window=4 << 20):
    """Every byte of `paths` with preads of `window` bytes into one reused
    buffer of that size. 4 MiB (the baseline) stays in the CPU caches, so it
    is the strict one; 32 MiB (a big tensor's box, the memory traffic of
    Checkpoint.read into its reused output buffer) is printed beside it."""
    buf = memoryview(bytearray(window))
    n = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            off = 0
            while True:
                k = os.preadv(fd, [buf], off)
                if k <= 0:
                    break
                off += k
            n += off
        finally:
            os.close(fd)
    return n


def timed(fn, sources, cold):
    if cold:
        drop_cache(sources)
    t = time.perf_counter()
    n = fn()
    return n, time.perf_counter() - t


def main():
    a, ckpt, sources, src_bytes, index = bench_checkpoint()
    import torch
    import torch.distributed.checkpoint as dcp

    import ckptfs
    import ckptfs.torch as ctorch

    # Rank 1 of 4 without other processes: a fake process group, so that dcp.load
    # (no_dist) plans exactly this rank's DTensor shards.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    mesh = init_device_mesh("cpu", (4,))

    ck = ckptfs.open(ckpt, index=index)
    big = [t for t in ck.tensors() if t.name.startswith("model.layers.")]
    rows, cols = big[0].shape
    q = cols // 4
    rank1 = [p for p in sources if os.path.basename(p).startswith("__1_")]
    buf = np.empty((rows, q), np.float32)

    def slice_read():
        for t in big:
            ck.read(t.name, box=(slice(None), slice(q, 2 * q)), out=buf)
        return len(big) * buf.nbytes

    rules = index + "-rules.json"
    with open(rules, "w") as f:
        json.dump({"rules": [{"match": r"^(model\.)?layers\.\d+\.w$", "split": "dim", "dim": 1}]}, f)
    mnt = tempfile.mkdtemp(prefix="ckptfs-py-mnt-")
    r = subprocess.run([a.bin, "mount", ckpt, mnt, "--index", index + "-mnt", "--rules", rules,
                        "--log", mnt + ".log"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    try:
        rank_file = os.path.join(mnt, "topo", "tp4-pp1", "tp1-pp0.safetensors")
        os.stat(rank_file)  # plans the view

        def mount_read():
            return pread_files([rank_file], window=1 << 20)  # what the kernel splits FUSE reads into anyway

        sd = {t.key: torch.empty(t.shape, dtype=getattr(torch, t.dtype)) for t in ck.tensors() if t.role != "other"}

        shards = {t.key: DTensor.from_local(torch.empty(rows, q), mesh, [Shard(1)], run_check=False,
                                            shape=torch.Size(t.shape), stride=(cols, 1)) for t in big}

        def slice_load_with(reader):
            def go():
                dcp.load(shards, storage_reader=reader, no_dist=True)
                return len(big) * rows * q * 4
            return go

        def load_with(reader):
            def go():
                dcp.load(sd, storage_reader=reader, no_dist=True)
                return sum(v.numel() * v.element_size() for v in sd.values())
            return go

        rows_out = []
        for cold in (True, False):
            label = "cold" if cold else "warm"
            if not cold:  # warm: everything read once before
                pread_files(sources)
            base_n, base_t = timed(lambda: pread_files(rank1), sources, cold)
            for name, fn in [("Checkpoint.read", slice_read), ("mount topo file", mount_read),
                             ("dcp.load + ckptfs StorageReader", slice_load_with(ctorch.StorageReader(ckpt, index=index))),
                             ("dcp.load + FileSystemReader", slice_load_with(dcp.FileSystemReader(ckpt)))]:
                n, t = timed(fn, sources, cold)
                rows_out.append(("slice tp4 rank 1", label, name, n, t, (n / t) / (base_n / base_t)))
            rows_out.append(("slice tp4 rank 1", label, "pread source rank 1 (4 MiB)", base_n, base_t, 1.0))
            n, t = timed(lambda: pread_files(rank1, window=32 << 20), sources, cold)
            rows_out.append(("slice tp4 rank 1", label, "pread source rank 1 (32 MiB)", n, t,
                             (n / t) / (base_n / base_t)))
            all_n, all_t = timed(lambda: pread_files(sources), sources, cold)
            for name, fn in [("dcp.load + ckptfs StorageReader", load_with(ctorch.StorageReader(ckpt, index=index))),
                             ("dcp.load + FileSystemReader", load_with(dcp.FileSystemReader(ckpt)))]:
                n, t = timed(fn, sources, cold)
                rows_out.append(("whole checkpoint", label, name, n, t, (n / t) / (all_n / all_t)))
            rows_out.append(("whole checkpoint", label, "pread every shard", all_n, all_t, 1.0))

        # Threads over row quarters of every big tensor (warm).
        quarter = np.empty((rows // 4, cols), np.float32)
        outs = [np.empty_like(quarter) for _ in range(2)]

        def quarters(k, step):
            for t in big:
                for i in range(k, 4, step):
                    ck.read(t.name, box=(slice(i * rows // 4, (i + 1) * rows // 4),), out=outs[k])

        thread_rows = []
        for n_threads in (1, 2):
            ths = [threading.Thread(target=quarters, args=(k, n_threads)) for k in range(n_threads)]
            t0 = time.perf_counter()
            for th in ths:
                th.start()
            for th in ths:
                th.join()
            dt = time.perf_counter() - t0
            thread_rows.append((n_threads, len(big) * 4 * quarter.nbytes / dt / 1e9))
    finally:
        subprocess.run([a.bin, "umount", mnt], capture_output=True)
        dist.destroy_process_group()

    print(f"checkpoint: {ckpt} ({src_bytes / 2**30:.2f} GiB, {len(sources)} shard files), {os.cpu_count()} cores")
    print(f"{'read':18} {'cache':5} {'method':32} {'MiB':>7} {'s':>7} {'GB/s':>6} {'vs pread 4 MiB':>14}")
    for what, label, name, n, t, ratio in rows_out:
        print(f"{what:18} {label:5} {name:32} {n / 2**20:7.0f} {t:7.3f} {n / t / 1e9:6.2f} {ratio:13.2f}x")
    one = thread_rows[0][1]
    for n_threads, gbs in thread_rows:
        print(f"threads: {n_threads} reading row quarters of every big tensor (warm): {gbs:.2f} GB/s "
              f"({gbs / one:.2f}x one thread)")


if __name__ == "__main__":
    main()

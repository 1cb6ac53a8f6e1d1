"""topo/ benchmark on the 2 GiB DCP benchmark checkpoint (4 ranks, 2016 params
column-sharded on dim 1; a rules file says layers.<i>.w split on dim 1):

  * lookup -> first byte: a fresh mount, the first stat of topo/tp<T>-pp1
    (planning every tensor's slice) through open + first 4 KiB of a rank file;
  * first read of a whole rank file (cold page cache, 1 MiB reads) vs reading
    the same number of bytes of the source shards in the same run:
      tp4-pp1 rank 0 = source rank 0's column block (contiguous runs),
      tp2-pp1 rank 0 = two source blocks interleaved row by row (strided);
  * mmap: the same rank file of another fresh mount read through mmap
    (numpy over the mapping) vs read().

    python bench/topo_bench.py [--ckpt DIR] [--gib 2.0] [--bin build/ckptfs]
"""
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dcp_bench import bench_checkpoint, drop_cache  # noqa: E402

CHUNK = 1 << 20


def read_all(path):
    n = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            b = f.read(CHUNK)
            if not b:
                return n
            n += len(b)


def read_bytes_of(paths, total):
    """Reads `total` bytes from the start of the source shards, in order."""
    n = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n < total:
                b = f.read(min(CHUNK, total - n))
                if not b:
                    break
                n += len(b)
    return n


def mount(a, ckpt, index, rules):
    mnt = tempfile.mkdtemp(prefix="ckptfs-topo-mnt-")
    r = subprocess.run([a.bin, "mount", ckpt, mnt, "--index", index, "--rules", rules, "--log", mnt + ".log"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return mnt


def umount(a, mnt):
    subprocess.run([a.bin, "umount", mnt], check=True, capture_output=True)


def main():
    a, ckpt, sources, src_bytes, index = bench_checkpoint()
    rules = os.path.join(index, "..", os.path.basename(index) + "-rules.json")
    with open(rules, "w") as f:
        json.dump({"rules": [{"match": r"^(model\.)?layers\.\d+\.w$", "split": "dim", "dim": 1}]}, f)
    subprocess.run([a.bin, "index", ckpt, "--index", index], check=True, capture_output=True)
    results = []
    for topo in ("tp4-pp1", "tp2-pp1"):
        mnt = mount(a, ckpt, index, rules)
        try:
            drop_cache(sources)
            t0 = time.perf_counter()
            os.stat(os.path.join(mnt, "topo", topo))
            t_plan = time.perf_counter() - t0
            rank = os.path.join(mnt, "topo", topo, "tp0-pp0.safetensors")
            with open(rank, "rb", buffering=0) as f:
                f.read(4096)
            t_first = time.perf_counter() - t0
            drop_cache(sources)
            t0 = time.perf_counter()
            n = read_all(rank)
            t_read = time.perf_counter() - t0
            drop_cache(sources)
            t0 = time.perf_counter()
            m = read_bytes_of(sources, n)
            t_src = time.perf_counter() - t0
        finally:
            umount(a, mnt)
        # mmap on a fresh mount (nothing in the mount's page cache).
        mnt = mount(a, ckpt, index, rules)
        try:
            rank = os.path.join(mnt, "topo", topo, "tp0-pp0.safetensors")
            drop_cache(sources)
            t0 = time.perf_counter()
            with open(rank, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                arr = np.frombuffer(mm, dtype=np.uint8)
                s = int(arr[::4096].sum())  # touches every page
                del arr
            t_mmap = time.perf_counter() - t0
        finally:
            umount(a, mnt)
        gb = n / 1e9
        results.append((topo, t_plan, t_first, gb / t_read, m / 1e9 / t_src, gb / t_mmap, n, s))
    print(f"checkpoint: {ckpt} ({src_bytes / 2**30:.2f} GiB, {len(sources)} shard files), 2 cores, cold page cache")
    for topo, t_plan, t_first, r_gbs, s_gbs, m_gbs, n, _ in results:
        print(f"{topo}: plan {t_plan * 1e3:.0f} ms, lookup->first byte {t_first * 1e3:.0f} ms; "
              f"rank file {n / 2**20:.0f} MiB read {r_gbs:.2f} GB/s vs source {s_gbs:.2f} GB/s "
              f"(ratio {r_gbs / s_gbs:.2f}x); mmap {m_gbs:.2f} GB/s ({m_gbs / r_gbs:.2f}x read)")


if __name__ == "__main__":
    main()

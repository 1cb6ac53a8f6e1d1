"""ckptfs verify benchmark (issue 7). Prints measurements and ratios against
baselines measured in the same run; asserts nothing.

  baseline       `cat` of every source shard to /dev/null (raw read), cold cache
  hash baseline  Python reading every shard in 8 MiB blocks and hashing it with
                 zlib.crc32 (what a user's own checksum script does), cold cache
  verify         ckptfs verify --json: GB/s of tensor bytes hashed (xxh3) and checked
  verify --deep  the same pass plus NaN/Inf counts and norms
  warm cache     the same two runs with the shards in the page cache (CPU cost)
  bytes once     block input of the verify process (getrusage ru_inblock after a
                 cold-cache run, pread engine) against the source bytes: 1.0 means
                 every byte was read from storage once

Each timing is the median of 3 cold-cache runs (VM storage is noisy).

    python bench/verify_bench.py [--ckpt DIR] [--gib 2.0] [--bin build/ckptfs]
"""
import json
import os
import statistics
import subprocess
import sys
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from dcp_bench import bench_checkpoint, drop_cache  # noqa: E402


def run_rusage(args):
    """Runs `args`; returns (seconds, stdout, bytes read from storage by the child)."""
    t = time.perf_counter()
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    return time.perf_counter() - t, out, ru.ru_inblock * 512, p.returncode


def py_hash(paths):
    for p in paths:
        crc = 0
        with open(p, "rb", buffering=0) as f:
            while True:
                b = f.read(8 << 20)
                if not b:
                    break
                crc = zlib.crc32(b, crc)


def main():
    a, ckpt, sources, src_bytes, index = bench_checkpoint()
    subprocess.run([a.bin, "index", ckpt, "--index", index, "--force"], check=True, capture_output=True)

    cats, hashes, plain, deep = [], [], [], []
    rep = rep_deep = None
    for _ in range(3):
        drop_cache(sources)
        t = time.perf_counter()
        subprocess.run(["sh", "-c", 'cat "$@" > /dev/null', "cat"] + sources, check=True)
        cats.append(time.perf_counter() - t)
        drop_cache(sources)
        t = time.perf_counter()
        py_hash(sources)
        hashes.append(time.perf_counter() - t)
        drop_cache(sources)
        s, out, _, rc = run_rusage([a.bin, "verify", ckpt, "--json", "--index", index])
        plain.append(s)
        rep = json.loads(out)
        drop_cache(sources)
        s, out, _, rc = run_rusage([a.bin, "verify", ckpt, "--json", "--deep", "--index", index])
        deep.append(s)
        rep_deep = json.loads(out)
    # Warm page cache: what the checks cost in CPU (2 cores here).
    run_rusage([a.bin, "verify", ckpt, "--json", "--index", index])
    t_warm = run_rusage([a.bin, "verify", ckpt, "--json", "--index", index])[0]
    t_warm_deep = run_rusage([a.bin, "verify", ckpt, "--json", "--deep", "--index", index])[0]
    drop_cache(sources)
    _, _, inblock, _ = run_rusage([a.bin, "verify", ckpt, "--json", "--deep", "--engine", "pread", "--index", index])

    tensor_bytes = rep["summary"]["bytes_read"]
    t_cat, t_hash, t_plain, t_deep = (statistics.median(x) for x in (cats, hashes, plain, deep))
    gib = 1 << 30
    cat_gbs = src_bytes / t_cat / 1e9
    print()
    print(f"checkpoint        {ckpt}: {len(sources)} shard files, {src_bytes / gib:.2f} GiB, "
          f"{rep['summary']['tensors']} entries, verdict {rep['verdict']}")
    print(f"cat of sources    {t_cat:.3f} s  {cat_gbs:.2f} GB/s  (baseline)")
    print(f"python crc32      {t_hash:.3f} s  {src_bytes / t_hash / 1e9:.2f} GB/s  ({t_hash / t_cat:.2f}x the cat time)")
    print(f"verify            {t_plain:.3f} s  {tensor_bytes / t_plain / 1e9:.2f} GB/s hashed  "
          f"({(tensor_bytes / t_plain) / (src_bytes / t_cat):.2f}x of raw read, "
          f"{t_plain / t_hash:.2f}x the python checksum time)")
    print(f"verify --deep     {t_deep:.3f} s  {tensor_bytes / t_deep / 1e9:.2f} GB/s  "
          f"({t_deep / t_plain:.2f}x the plain verify time)")
    print(f"warm cache        verify {tensor_bytes / t_warm / 1e9:.2f} GB/s, --deep {tensor_bytes / t_warm_deep / 1e9:.2f} GB/s "
          f"(CPU-bound: xxh3 + zero checks, + NaN/Inf/norms)")
    print(f"bytes once        deep pass read {rep_deep['summary']['bytes_read'] / gib:.2f} GiB of tensors "
          f"(plain: {tensor_bytes / gib:.2f}); storage input {inblock / gib:.2f} GiB for "
          f"{src_bytes / gib:.2f} GiB of shards = {inblock / src_bytes:.2f}x")
    print(f"per run (s)       cat {', '.join(f'{x:.2f}' for x in cats)}; verify {', '.join(f'{x:.2f}' for x in plain)}; "
          f"deep {', '.join(f'{x:.2f}' for x in deep)}")


if __name__ == "__main__":
    main()

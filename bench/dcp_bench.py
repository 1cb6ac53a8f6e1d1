"""ckptfs DCP benchmark (issue 2). Prints measurements and ratios against a
baseline measured in the same run; asserts nothing.

  index build        ckptfs index --force: seconds and fragments/s
  remount            ckptfs mount (daemon) with an existing index, until the mount is live
  first read         every params/*/param.raw through the mount (cat), page cache of the
                     sources and of the mount dropped first, vs `cat` of the same source
                     .distcp files; 3 alternating repetitions, medians (VM storage is noisy)
  daemon peak RSS    VmHWM of the mount daemon after the reads

    python bench/dcp_bench.py [--ckpt DIR] [--gib 2.0] [--bin build/ckptfs]
"""
import argparse
import glob
import statistics
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def drop_cache(paths):
    """Evicts the files' pages (fadvise DONTNEED works without privileges for clean pages)."""
    subprocess.run(["sync"], check=True)
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(args, **kw):
    t = time.perf_counter()
    r = subprocess.run(args, **kw)
    return time.perf_counter() - t, r


def daemon_pid(mnt):
    out = subprocess.run(["pgrep", "-f", f"ckptfs mount .* {mnt}"], capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else None


def tagged(text, tag):
    """The fields of the last line of `text` that starts with `tag` (a worker's
    LOAD_SECONDS, GNU time's MAXRSS_KB)."""
    return [ln for ln in text.splitlines() if ln.startswith(tag)][-1].split()


def cold_mount(bin_path, ck, mnt, src):
    """Mounts `ck` at `mnt` with no index yet and the sources' cache dropped.
    Returns the mount's seconds (the index build included) and the daemon's pid."""
    shutil.rmtree(os.path.join(ck, ".ckptfs"), ignore_errors=True)
    os.makedirs(mnt, exist_ok=True)
    drop_cache(src)
    t0 = time.perf_counter()
    subprocess.run([bin_path, "mount", ck, mnt], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0, daemon_pid(mnt)


def vm_hwm_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def bench_checkpoint():
    """Parses --ckpt/--gib/--bin and writes the benchmark DCP checkpoint once.
    Returns (args, checkpoint dir, shard files, their bytes, a fresh index dir)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default=os.path.join(HERE, "out", "dcp-2gib"))
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--bin", default=os.path.join(HERE, "..", "build", "ckptfs"))
    a = ap.parse_args()
    ckpt = os.path.abspath(a.ckpt)
    if not os.path.exists(os.path.join(ckpt, ".metadata")):
        print(f"writing the benchmark checkpoint ({a.gib} GiB, 4 ranks, dim-1 shards) with torch ...", flush=True)
        subprocess.run([sys.executable, os.path.join(HERE, "make_big_dcp.py"), ckpt, "--gib", str(a.gib)], check=True)
    sources = sorted(glob.glob(os.path.join(ckpt, "__*")))
    src_bytes = sum(os.path.getsize(p) for p in sources)
    return a, ckpt, sources, src_bytes, tempfile.mkdtemp(prefix="ckptfs-bench-index-")


def main():
    a, ckpt, sources, src_bytes, index = bench_checkpoint()

    # Index build (from metadata only).
    drop_cache(sources + [os.path.join(ckpt, ".metadata")])
    t_index, r = timed([a.bin, "index", ckpt, "--index", index, "--force"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    frags = int(r.stdout.split(" fragments")[0].split()[-1])

    mnt = tempfile.mkdtemp(prefix="ckptfs-bench-mnt-")
    log = mnt + ".log"
    t_mount, r = timed([a.bin, "mount", ckpt, mnt, "--index", index, "--log", log], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    try:
        raws = sorted(glob.glob(os.path.join(mnt, "params", "*", "param.raw")))
        raw_bytes = sum(os.path.getsize(p) for p in raws)
        cats, reads = [], []
        for _ in range(3):
            drop_cache(sources)
            cats.append(timed(["sh", "-c", "cat \"$@\" > /dev/null", "cat"] + sources, check=True)[0])
            drop_cache(sources + raws)  # the mount's own pages too (keep_cache)
            reads.append(timed(["sh", "-c", "cat \"$@\" > /dev/null", "cat"] + raws, check=True)[0])
        t_cat, t_read = statistics.median(cats), statistics.median(reads)
        ratios = sorted((raw_bytes / r) / (src_bytes / c) for c, r in zip(cats, reads))
        pid = daemon_pid(mnt)
        rss_mib = vm_hwm_kib(pid) / 1024 if pid else float("nan")
    finally:
        subprocess.run([a.bin, "umount", mnt], check=False)
        os.rmdir(mnt)

    gib = 1 << 30
    cat_gbs = src_bytes / t_cat / 1e9
    read_gbs = raw_bytes / t_read / 1e9
    print()
    print(f"checkpoint        {ckpt}: {len(sources)} files, {src_bytes / gib:.2f} GiB, {frags} fragments")
    print(f"index build       {t_index:.3f} s  ({frags / t_index:,.0f} fragments/s)")
    print(f"remount (index)   {t_mount:.3f} s  (target < 1 s)")
    print(f"cat of sources    {t_cat:.3f} s  {cat_gbs:.2f} GB/s  (baseline)")
    print(f"first read (mnt)  {t_read:.3f} s  {read_gbs:.2f} GB/s  of {raw_bytes / gib:.2f} GiB param.raw")
    print(f"ratio             {read_gbs / cat_gbs:.2f}x of raw source read, medians (target >= 0.5x); "
          f"per pair {', '.join(f'{r:.2f}' for r in ratios)}")
    print(f"daemon peak RSS   {rss_mib:.0f} MiB  (target < 200 MiB)")


if __name__ == "__main__":
    main()

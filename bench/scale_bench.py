"""Scale benchmark (issue 18): checkpoints with the metadata of very large runs
and tiny tensors, written by the producers' own serializers (bench/scale/),
each measured in one run against the targets:

  index build  seconds, fragments per minute per CPU-second (target >= 1M), peak
               RSS of `ckptfs index` (target <= 512 MiB);
  mount        seconds from `ckptfs mount` to a served mountpoint with the index
               built (target < 1 s), daemon RSS after the listing (<= 256 MiB);
  ls -lR       of the whole tree on a fresh mount (target < 1 s for 100k files),
               then again on the same mount (listings cached by the kernel);
               its ceiling: the same tree served by bench/null_fuse.cc --tree,
               a daemon with the adapter's settings and no work to do;
  reference    every sampled tensor (REF.npz, written by the generator from the
               values it saved) equals what the mount serves, bit for bit.

Inputs are generated once into --out (default bench/out/scale) and reused:

  dcp       bench/scale/make_dcp_scale.py: 112 ranks x 16384 tensors, 1.84M chunks,
            a 209 MiB .metadata
            (torch's SavePlan / FileSystemWriter)
  deepspeed bench/scale/make_deepspeed_scale.py: ZeRO-2 at DP=768, re-partitioned
            from a real engine save with DeepSpeed's own geometry
  bloom     the same, BLOOM-176B's PipelineEngine layout PP=12 x TP=4 x DP=8
  megatron  bench/scale/make_megatron_scale.py: torch_dist with 100k ShardedTensors
            (megatron-core's dist_checkpointing.save, 4 gloo ranks)
  dcp_heavy make_dcp_scale.py with 4 ranks x 40000 tensors: tensor-heavy (160k chunks,
            a 23 MiB .metadata)

Read throughput against the null-FUSE ceiling is bench/read_bench.py
(`bash bench/run.sh scale` runs both).

    python bench/scale_bench.py [--inputs dcp,deepspeed,bloom,megatron,dcp_heavy] [--dcp-ranks 112 --dcp-tensors 16384]
"""
import argparse
import collections
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MIB = 1 << 20


def run_measured(cmd):
    """Runs cmd; returns (wall s, cpu s of the child, peak RSS bytes, stdout+stderr)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-f", "MAXRSS_KB=%M"] + cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    rss = 0
    for line in r.stderr.splitlines():
        if line.startswith("MAXRSS_KB="):
            rss = int(line.split("=")[1]) * 1024
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}{r.stderr}")
    return wall, cpu, rss, r.stdout + r.stderr


def rss_of(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def daemon_pid(mnt):
    """The pid of the ckptfs daemon serving mnt (its command line names it)."""
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if args and args[0].endswith(b"ckptfs") and b"mount" in args and mnt.encode() in args:
            return int(p)
    return None


def inputs(a):
    """name -> (generator script, its arguments)."""
    return {
        "dcp": ("make_dcp_scale.py", ["--ranks", str(a.dcp_ranks), "--tensors", str(a.dcp_tensors)]),
        "deepspeed": ("make_deepspeed_scale.py", ["--layout", "zero", "--dp", "768", "--stage", "2"]),
        "bloom": ("make_deepspeed_scale.py", ["--layout", "bloom", "--pp", "12", "--tp", "4", "--dp", "8"]),
        "megatron": ("make_megatron_scale.py", ["--tensors", str(a.megatron_tensors)]),
        # Tensor-heavy: many tensors, few ranks (issue 44): 40k tensors x 4 ranks.
        "dcp_heavy": ("make_dcp_scale.py", ["--ranks", "4", "--tensors", str(a.heavy_tensors)]),
    }


def generate(name, a, out):
    """Makes input `name` under out/ unless it is there, made with the same
    generator arguments (out/<name>.args); returns (ckpt dir, ref npz)."""
    ckpt, ref = os.path.join(out, name), os.path.join(out, name + ".ref.npz")
    script, args = inputs(a)[name]
    stamp = os.path.join(out, name + ".args")
    made_with = open(stamp).read() if os.path.exists(stamp) else None
    if os.path.exists(ref) and made_with == json.dumps([script] + args):
        return ckpt, ref
    shutil.rmtree(ckpt, ignore_errors=True)
    for old in (ref, stamp):
        if os.path.exists(old):
            os.remove(old)
    print(f"{name}: generating (once) ...", flush=True)
    t0 = time.time()
    subprocess.run([sys.executable, os.path.join(HERE, "scale", script), ckpt, "--ref", ref] + args, check=True)
    with open(stamp, "w") as f:
        f.write(json.dumps([script] + args))
    print(f"{name}: generated in {time.time() - t0:.0f} s", flush=True)
    return ckpt, ref


def ratio(value, target, higher_is_better):
    r = value / target if higher_is_better else target / max(value, 1e-9)
    return f"{r:5.2f}x {'ok' if r >= 1.0 else 'MISSED'}"


def tree_of(mnt):
    """The mount's tree: [(relative path, is_dir, size)], a parent before its
    children and each directory's children in the order it lists them."""
    entries, todo = [], collections.deque([""])
    while todo:
        rel = todo.popleft()
        with os.scandir(os.path.join(mnt, rel)) as it:
            for e in it:
                path = os.path.join(rel, e.name) if rel else e.name
                st = e.stat(follow_symlinks=False)
                is_dir = e.is_dir(follow_symlinks=False)
                entries.append((path, is_dir, st.st_size))
                if is_dir:
                    todo.append(path)
    return entries


def timed_ls_lR(root):
    t0 = time.perf_counter()
    subprocess.run(["ls", "-lR", root], capture_output=True, check=True)
    return time.perf_counter() - t0


def native_ls_lR(tree, out):
    """`ls -lR` of the same tree shape (directories and empty files, made
    in `out`'s file system, caches warm): what the VM does without FUSE."""
    root = tempfile.mkdtemp(prefix="ckptfs-scale-lsref-", dir=out)
    try:
        for path, is_dir, _ in tree:
            if is_dir:
                os.mkdir(os.path.join(root, path))
            else:
                open(os.path.join(root, path), "wb").close()
        timed_ls_lR(root)  # warm
        return timed_ls_lR(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def null_fuse_ls_lR(tree, null_fuse):
    """`ls -lR` of the same tree (names, sizes, listing order) served by
    ckptfs_null_fuse (bench/null_fuse.cc): the adapter's settings and replies
    built before mounting, so no daemon can list faster on this kernel.
    Returns (fresh mount s, again s)."""
    bad = next((path for path, _, _ in tree if "\n" in path), None)
    if bad is not None:
        sys.exit(f"null_fuse --tree cannot serve a name with a newline: {bad!r}")
    mnt = tempfile.mkdtemp(prefix="ckptfs-scale-null-mnt-")
    spec = mnt + ".tree"
    with open(spec, "w", encoding="utf-8", errors="surrogateescape") as f:
        for path, is_dir, size in tree:
            f.write(f"{'d' if is_dir else 'f'}\t{path}\t{size}\n")
    proc = subprocess.Popen([null_fuse, mnt, "--tree", spec], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for _ in range(1000):
            if os.path.ismount(mnt):
                break
            if proc.poll() is not None:
                sys.exit(f"null_fuse failed: {proc.stderr.read().decode()}")
            time.sleep(0.01)
        os.stat(os.path.join(mnt, "params"))
        return timed_ls_lR(mnt), timed_ls_lR(mnt)
    finally:
        subprocess.run(["umount", mnt], capture_output=True)
        proc.wait(timeout=30)
        os.remove(spec)
        if not os.path.ismount(mnt):
            os.rmdir(mnt)


def bench_one(name, ckpt, ref, a):
    res = {"input": name}
    meta = os.path.join(ckpt, ".metadata")
    if os.path.exists(meta):
        res["metadata_mib"] = os.path.getsize(meta) / MIB
    index = tempfile.mkdtemp(prefix=f"ckptfs-scale-{name}-ix-")
    shutil.rmtree(index)
    subprocess.run(["sync"], check=True)
    wall, cpu, rss, out = run_measured([a.bin, "index", ckpt, "--index", index, "-q"])
    frags = 0
    for tok in out.split(","):
        if tok.strip().endswith("fragments"):
            frags = int(tok.split()[0])
    res.update(index_s=wall, index_cpu_s=cpu, fragments=frags, index_rss=rss,
               frags_per_min_core=frags / max(cpu, 1e-9) * 60)
    mnt = tempfile.mkdtemp(prefix=f"ckptfs-scale-{name}-mnt-")
    t0 = time.perf_counter()
    r = subprocess.run([a.bin, "mount", ckpt, mnt, "--index", index, "--log", mnt + ".log"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"mount failed: {r.stderr}")
    os.stat(os.path.join(mnt, "params"))
    res["mount_s"] = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        ls = subprocess.run(["ls", "-lR", mnt], capture_output=True, check=True)
        res["ls_lR_s"] = time.perf_counter() - t0
        res["files"] = sum(1 for line in ls.stdout.splitlines() if line.startswith(b"-"))
        t0 = time.perf_counter()  # again: the kernel's cached listings and attributes
        subprocess.run(["ls", "-lR", mnt], capture_output=True, check=True)
        res["ls_lR_again_s"] = time.perf_counter() - t0
        pid = daemon_pid(mnt)
        res["daemon_rss"] = rss_of(pid) if pid else 0
        tree = tree_of(mnt)
        res["ls_lR_native_s"] = native_ls_lR(tree, a.out)
        res["ls_lR_null_s"], res["ls_lR_null_again_s"] = null_fuse_ls_lR(tree, a.null_fuse)
        bad = []
        with np.load(ref) as z:
            for key in z.files:
                got = np.load(os.path.join(mnt, key))
                want = z[key]
                if got.dtype != want.dtype or got.shape != want.shape or got.tobytes() != want.tobytes():
                    bad.append(key)
            res["reference_checked"] = len(z.files)
        res["reference_mismatches"] = bad
        # A remount of the same index: the plans the first mount saved beside
        # it (dcp/, a DCP profile) are loaded instead of made.
        subprocess.run([a.bin, "umount", mnt], capture_output=True, check=True)
        r = subprocess.run([a.bin, "mount", ckpt, mnt, "--index", index, "--log", mnt + ".log"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"mount failed: {r.stderr}")
        t0 = time.perf_counter()
        subprocess.run(["ls", "-lR", mnt], capture_output=True, check=True)
        res["ls_lR_remount_s"] = time.perf_counter() - t0
        pid = daemon_pid(mnt)
        res["daemon_rss_remount"] = rss_of(pid) if pid else 0
    finally:
        subprocess.run([a.bin, "umount", mnt], capture_output=True)
        shutil.rmtree(index, ignore_errors=True)
        for leftover in (index + ".lock", mnt + ".log"):
            if os.path.exists(leftover):
                os.remove(leftover)
        if os.path.isdir(mnt) and not os.path.ismount(mnt):
            os.rmdir(mnt)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "ckptfs"))
    ap.add_argument("--null-fuse", default=os.path.join(ROOT, "build", "ckptfs_null_fuse"))
    ap.add_argument("--out", default=os.path.join(HERE, "out", "scale"))
    ap.add_argument("--inputs", default="dcp,deepspeed,bloom,megatron,dcp_heavy")
    ap.add_argument("--dcp-ranks", type=int, default=112)
    ap.add_argument("--dcp-tensors", type=int, default=16384)
    ap.add_argument("--megatron-tensors", type=int, default=100000)
    ap.add_argument("--heavy-tensors", type=int, default=40000, help="dcp_heavy: tensors (x 4 ranks)")
    a = ap.parse_args()
    for b in (a.bin, a.null_fuse):
        if not os.path.exists(b):
            sys.exit(f"{b}: not built (scripts/build.sh, or bash bench/run.sh scale)")
    os.makedirs(a.out, exist_ok=True)
    results = []
    for name in a.inputs.split(","):
        if name not in inputs(a):
            sys.exit(f"unknown input {name} (known: {', '.join(inputs(a))})")
        results.append(bench_one(name, *generate(name, a, a.out), a))
    print(f"\nscale benchmark, {os.uname().nodename}, {os.cpu_count()} cores")
    for r in results:
        print(f"\n[{r['input']}] {r['fragments']} fragments"
              + (f", .metadata {r['metadata_mib']:.0f} MiB" if "metadata_mib" in r else "")
              + f", {r['files']} files in the tree")
        print(f"  index build      {r['index_s']:8.2f} s wall, {r['index_cpu_s']:.2f} s CPU")
        print(f"  fragments/min/core {r['frags_per_min_core'] / 1e6:6.2f} M   target >= 1 M     {ratio(r['frags_per_min_core'], 1e6, True)}")
        wall_rate = r['fragments'] / (r['index_s'] / 60) / os.cpu_count()
        print(f"  fragments/min per core of wall time on all {os.cpu_count()} cores {wall_rate / 1e6:5.2f} M   "
              f"target >= 1.5 M {ratio(wall_rate, 1.5e6, True)}")
        print(f"  index peak RSS   {r['index_rss'] / MIB:8.0f} MiB target <= 512 MiB {ratio(r['index_rss'] / MIB, 512, False)}")
        print(f"  mount            {r['mount_s']:8.3f} s   target < 1 s      {ratio(r['mount_s'], 1.0, False)}")
        print(f"  daemon RSS       {r['daemon_rss'] / MIB:8.0f} MiB target <= 256 MiB {ratio(r['daemon_rss'] / MIB, 256, False)}")
        print(f"  ls -lR           {r['ls_lR_s']:8.3f} s   target < 1 s per 100k files "
              f"{ratio(r['ls_lR_s'], max(r['files'], 1) / 100_000, False)}")
        print(f"    again on the same mount: {r['ls_lR_again_s']:.3f} s; the same tree on this machine's own "
              f"file system, warm: {r['ls_lR_native_s']:.3f} s")
        print(f"    ceiling: the same tree from the null FUSE daemon {r['ls_lR_null_s']:.3f} s fresh "
              f"({r['ls_lR_null_again_s']:.3f} s again); ckptfs at {r['ls_lR_null_s'] / r['ls_lR_s']:.2f}x of it")
        print(f"    target: within 1.05x of the null daemon's fresh listing: "
              f"{ratio(r['ls_lR_s'], 1.05 * r['ls_lR_null_s'], False)}")
        print(f"    a remount of the same index (saved plans loaded): {r['ls_lR_remount_s']:.3f} s, "
              f"{ratio(r['ls_lR_remount_s'], 1.05 * r['ls_lR_null_s'], False)} against 1.05x the null daemon; "
              f"daemon RSS {r['daemon_rss_remount'] / MIB:.0f} MiB {ratio(r['daemon_rss_remount'] / MIB, 256, False)}")
        print(f"  reference        {r['reference_checked']} tensors, "
              f"{'all equal' if not r['reference_mismatches'] else 'MISMATCH: ' + ', '.join(r['reference_mismatches'])}")
    path = os.path.join(a.out, f"scale-{os.uname().nodename}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {path}")
    if any(r["reference_mismatches"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()

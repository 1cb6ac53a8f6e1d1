"""ckptfs DeepSpeed benchmark (issue 3). Prints measurements and ratios against
DeepSpeed's own ds_to_universal.py measured in the same run; asserts nothing.

A ZeRO-2, DP=4 checkpoint (>= 1 GiB) is written by the real DeepSpeed engine on
CPU (tests/fixtures/make_deepspeed.py, scaled up), once, under bench/out/.

  baseline   ds_to_universal.py (default 4 extract / 2 merge workers): wall time,
             peak RSS of its largest process (GNU time %M), temp space it wrote
  (a)        ckptfs mount (daemon, no index yet) until the first byte of the
             largest universal/zero/*/fp32.pt is read
  (b)        cp -r <mount>/universal to local disk
  memory     VmHWM of the mount daemon after (b); files ckptfs added to the
             checkpoint directory besides its index (must be none)

Source page cache is dropped (fadvise) before each timed run.

    python bench/ds_bench.py [--layers 8] [--hidden 1024] [--bin build/ckptfs]
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from dcp_bench import daemon_pid, drop_cache, tagged, timed, vm_hwm_kib  # noqa: E402


def files_under(d, skip=(".ckptfs",)):
    out = []
    for root, dirs, files in os.walk(d):
        dirs[:] = [x for x in dirs if x not in skip]
        out += [os.path.join(root, f) for f in files]
    return sorted(out)


def du(d):
    return sum(os.path.getsize(f) for f in files_under(d))


DS_ENV = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")


def zero2_checkpoint(layers, hidden):
    """The benchmark's ZeRO-2 DP=4 checkpoint under bench/out/ (written once by the real
    DeepSpeed engine on CPU): (checkpoint dir, tag, its files)."""
    ck = os.path.join(HERE, "out", f"ds-zero2-dp4-L{layers}-H{hidden}")
    if not os.path.exists(os.path.join(ck, "reference_tp0.pt")):
        shutil.rmtree(ck, ignore_errors=True)
        print(f"writing {ck} with deepspeed ...", flush=True)
        subprocess.run([sys.executable, os.path.join(ROOT, "tests", "fixtures", "make_deepspeed.py"), ck,
                        "--stage", "2", "--dp", "4", "--steps", "1", "--layers", str(layers),
                        "--hidden", str(hidden), "--ffn", str(2 * hidden)], check=True, env=DS_ENV,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tag = open(os.path.join(ck, "latest")).read().strip()
    src = files_under(os.path.join(ck, tag))
    size = sum(os.path.getsize(f) for f in src)
    print(f"checkpoint: {ck}/{tag}: {len(src)} files, {size / 2**30:.2f} GiB", flush=True)
    return ck, tag, src


def ds_to_universal(ck, tag, src, out, keep_temp=False):
    """DeepSpeed's own offline converter on the checkpoint, the source's cache
    dropped first: (wall seconds, peak RSS in KiB of its largest process)."""
    import deepspeed
    script = os.path.join(os.path.dirname(deepspeed.__file__), "checkpoint", "ds_to_universal.py")
    drop_cache(src)
    t, r = timed(["/usr/bin/time", "-f", "MAXRSS_KB %M", sys.executable, script, "--input_folder",
                  os.path.join(ck, tag), "--output_folder", out] + (["--keep_temp_folder"] if keep_temp else []),
                 env=DS_ENV, capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stdout[-2000:], r.stderr[-3000:])
        raise SystemExit("ds_to_universal.py failed")
    return t, int(tagged(r.stderr, "MAXRSS_KB")[1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "ckptfs"))
    a = ap.parse_args()
    ck, tag, src = zero2_checkpoint(a.layers, a.hidden)

    work = tempfile.mkdtemp(prefix="ds-bench-", dir=os.path.join(HERE, "out"))
    try:
        out = os.path.join(work, "ucp", "universal")
        t_base, rss_base = ds_to_universal(ck, tag, src, out, keep_temp=True)
        tmp_bytes = du(os.path.join(out, "tmp"))
        ucp_bytes = du(out) - tmp_bytes
        largest = max((os.path.join(dp, f) for dp, _, fs in os.walk(os.path.join(out, "zero")) for f in fs
                       if f == "fp32.pt"), key=os.path.getsize)
        largest_rel = os.path.relpath(largest, out)
        print(f"baseline ds_to_universal.py: {t_base:.2f} s, peak RSS {rss_base / 1024:.0f} MiB, "
              f"temp files {tmp_bytes / 2**20:.0f} MiB, output {ucp_bytes / 2**20:.0f} MiB")

        before = files_under(ck)
        shutil.rmtree(os.path.join(ck, ".ckptfs"), ignore_errors=True)
        mnt = os.path.join(work, "mnt")
        os.makedirs(mnt)
        drop_cache(src)
        t0 = time.perf_counter()
        subprocess.run([a.bin, "mount", ck, mnt], check=True)
        with open(os.path.join(mnt, "universal", largest_rel), "rb") as f:
            assert len(f.read(1)) == 1
        t_first = time.perf_counter() - t0
        pid = daemon_pid(mnt)
        try:
            drop_cache(src)
            dst = os.path.join(work, "copy")
            t_cp, r = timed(["cp", "-r", os.path.join(mnt, "universal"), dst])
            assert r.returncode == 0
            hwm = vm_hwm_kib(pid) if pid else -1
        finally:
            subprocess.run([a.bin, "umount", mnt])
        after = files_under(ck)
        print(f"(a) mount -> first byte of {largest_rel} ({os.path.getsize(largest) / 2**20:.0f} MiB): "
              f"{t_first:.3f} s   ratio baseline/ckptfs = {t_base / t_first:.0f}x  (target >= 100x)")
        print(f"(b) cp -r universal/: {t_cp:.2f} s   ratio ckptfs/baseline = {t_cp / t_base:.2f}  (target <= 0.5)")
        print(f"daemon peak RSS {hwm / 1024:.0f} MiB (target <= 256 MiB); baseline largest process "
              f"{rss_base / 1024:.0f} MiB")
        print(f"files added to the checkpoint besides .ckptfs/: {len(set(after) - set(before))}; "
              f"copied tree {du(dst) / 2**20:.0f} MiB (tensor equality with the baseline is what the tests check)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Time to resume at a new topology (issue 41): from "checkpoint on disk, nothing
cached" to "every weight and optimizer state loaded at the new world size".
Prints measurements and ratios against DeepSpeed's own offline path measured
in the same run; asserts nothing.

The checkpoint is ds_bench.py's: ZeRO-2, DP=4, >= 1 GiB, written by the real
DeepSpeed engine on CPU under bench/out/ (once).

  offline   ds_to_universal.py (its default workers): wall time and peak RSS of
            its largest process. This is only the conversion; loading the
            universal checkpoint into an engine comes on top of it, so the
            ratio below favours the offline path.
  ckptfs    ckptfs mount (no index yet) + torch's own FileSystemReader and
            dcp.load of every model.* and optim.state.* key of <mount>/dcp into
            DTensors on 3 gloo ranks (Shard(0)): a topology the source never
            had (tests/fixtures/dcp_view_worker.py): wall time from the mount
            command to the last rank's load, dcp.load's own time, peak RSS of
            the daemon and of the largest loader process.

Source page cache is dropped (fadvise) before each timed run.

    python bench/resume_bench.py [--layers 8] [--hidden 1024] [--world 3] [--bin build/ckptfs]
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
from dcp_bench import cold_mount, tagged, vm_hwm_kib  # noqa: E402
from ds_bench import ds_to_universal, zero2_checkpoint  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "ckptfs"))
    a = ap.parse_args()
    ck, tag, src = zero2_checkpoint(a.layers, a.hidden)

    work = tempfile.mkdtemp(prefix="resume-bench-", dir=os.path.join(HERE, "out"))
    try:
        t_off, rss_off = ds_to_universal(ck, tag, src, os.path.join(work, "ucp"))
        print(f"offline: ds_to_universal.py {t_off:.2f} s, peak RSS {rss_off / 1024:.0f} MiB "
              f"(the engine's universal load not included)", flush=True)

        mnt = os.path.join(work, "mnt")
        t_mount, pid = cold_mount(a.bin, ck, mnt, src)
        t0 = time.perf_counter() - t_mount  # when the mount command started
        try:
            r = subprocess.run(["/usr/bin/time", "-f", "MAXRSS_KB %M", sys.executable,
                                os.path.join(ROOT, "tests", "fixtures", "dcp_view_worker.py"),
                                "--dcp", os.path.join(mnt, "dcp"), "--world", str(a.world),
                                "--prefixes", "model.,optim.state."],
                               cwd=os.path.join(ROOT, "tests", "fixtures"), capture_output=True, text=True)
            t_ck = time.perf_counter() - t0
            hwm = vm_hwm_kib(pid) if pid else -1
        finally:
            subprocess.run([a.bin, "umount", mnt], stdout=subprocess.DEVNULL)
        if r.returncode != 0:
            print(r.stdout[-2000:], r.stderr[-3000:])
            raise SystemExit("dcp.load from the mount failed")
        load = tagged(r.stdout, "LOAD_SECONDS")
        rss_loader = int(tagged(r.stderr, "MAXRSS_KB")[1])
        t_resume = t_mount + float(load[1])
        print(f"ckptfs: mount (index built) {t_mount:.2f} s + dcp.load of {load[3]} keys at world {a.world} "
              f"{float(load[1]):.2f} s = {t_resume:.2f} s; with starting the {a.world} loader processes "
              f"{t_ck:.2f} s", flush=True)
        print(f"        daemon peak RSS {hwm / 1024:.0f} MiB (mapped source pages included), largest loader "
              f"process {rss_loader / 1024:.0f} MiB", flush=True)
        print(f"ratio ckptfs / offline conversion: time {t_resume / t_off:.2f} (target < 1: loaded at the new "
              f"topology before the converter finishes); with process start {t_ck / t_off:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""16-reader stress of a live mount: every file of the view is read once
through `ckptfs cat` (the FUSE-free core) as the reference, then N threads
pread random ranges of random files through the mount for --seconds, each
read preceded by POSIX_FADV_DONTNEED so the page cache does not answer for
the daemon. Prints reads, bytes and mismatches; exits 1 on any mismatch or
unexpected error.

    bench/stress.py SRC [--threads 16] [--seconds 60] [--bin build/ckptfs]
"""
import argparse
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--bin", default=str(Path(__file__).resolve().parents[1] / "build" / "ckptfs"))
    ap.add_argument("--max-files", type=int, default=400)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ckptfs-stress-"))
    mnt, ix = tmp / "mnt", tmp / "ix"
    mnt.mkdir()
    proc = subprocess.Popen([a.bin, "mount", "-f", a.src, str(mnt), "--index", str(ix)],
                            stdout=open(tmp / "log", "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.time() > deadline:
                sys.exit(f"mount did not come up: {(tmp / 'log').read_text()[-2000:]}")
            time.sleep(0.05)
        files = []
        for root, _, names in os.walk(mnt):
            for n in names:
                rel = os.path.relpath(os.path.join(root, n), mnt)
                if rel.startswith((".ckptfs", "topo/")) or n == "ERRORS":
                    continue
                files.append(rel)
        random.seed(0)
        random.shuffle(files)
        files = sorted(files[: a.max_files])
        ref = {}
        for rel in files:
            r = subprocess.run([a.bin, "cat", a.src, rel, "--index", str(ix)], capture_output=True, timeout=600)
            if r.returncode == 0 and r.stdout:
                ref[rel] = r.stdout
        names = sorted(ref)
        stats = {"reads": 0, "bytes": 0, "mismatches": 0, "errors": 0}
        lock = threading.Lock()
        stop = time.time() + a.seconds

        def worker(seed):
            rng = random.Random(seed)
            fds = {}
            reads = nbytes = bad = errs = 0
            while time.time() < stop:
                rel = rng.choice(names)
                want = ref[rel]
                off = rng.randrange(len(want))
                n = rng.choice([1, 7, 4096, 65536, 1 << 20, len(want)])
                fd = fds.get(rel) or fds.setdefault(rel, os.open(mnt / rel, os.O_RDONLY))
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                try:
                    got = os.pread(fd, n, off)
                except OSError:
                    errs += 1
                    continue
                reads += 1
                nbytes += len(got)
                if got != want[off:off + n]:
                    bad += 1
            for fd in fds.values():
                os.close(fd)
            with lock:
                stats["reads"] += reads
                stats["bytes"] += nbytes
                stats["mismatches"] += bad
                stats["errors"] += errs

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(a.threads)]
        t0 = time.time()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        dt = time.time() - t0
        print(f"stress: {a.threads} readers x {dt:.0f} s over {len(names)} files: {stats['reads']} reads, "
              f"{stats['bytes'] / 1e9:.2f} GB, {stats['mismatches']} mismatches, {stats['errors']} errors")
        sys.exit(1 if stats["mismatches"] or stats["errors"] else 0)
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True)
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()

"""ckptfs Megatron-LM benchmark (issue 4). Prints measurements and ratios against
a baseline measured in the same run; asserts nothing.

A legacy-format TP=2 PP=2 checkpoint (bf16 model, fp32 masters and Adam states)
is written by the real megatron-core on CPU (tests/fixtures/make_megatron.py,
scaled up), once, under bench/out/.

  baseline   what users run today to see global tensors: torch.load every
             mp_rank file and merge every parameter with Megatron's TP rules
             and layer renumbering (tools/checkpoint's loader does the same);
             wall time and peak RSS (GNU time %M)
  (a)        ckptfs mount (no index yet) until the first byte of the largest
             params/*/param.raw is read
  (b)        every params/*/param.raw read (the merged model) via cp -r
  memory     VmHWM of the mount daemon after (b)

Source page cache is dropped (fadvise) before each timed run.

    python bench/megatron_bench.py [--layers 8] [--hidden 1024] [--bin build/ckptfs]
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
from ds_bench import files_under  # noqa: E402

BASELINE = r'''
import glob, os, sys, torch
it = open(os.path.join(sys.argv[1], "latest_checkpointed_iteration.txt")).read().strip()
d = os.path.join(sys.argv[1], f"iter_{int(it):07d}")
tp, pp, layers = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def rule(n):
    if "layernorm" in n or "position_embeddings" in n: return "rep"
    if ".linear_proj." in n or ".linear_fc2." in n: return "rep" if n.endswith(".bias") else "row"
    if ".linear_fc1." in n: return "glu"
    return "col"
merged = {}
for p in range(pp):
    shards = [torch.load(f"{d}/mp_rank_{t:02d}_{p:03d}/model_optim_rng.pt", weights_only=False, map_location="cpu")["model"]
              for t in range(tp)]
    for name, t0 in shards[0].items():
        if not torch.is_tensor(t0): continue
        parts = [s[name] for s in shards]
        r = rule(name)
        if r == "rep": g = parts[0]
        elif r == "row": g = torch.cat(parts, 1)
        elif r == "glu":
            h = [x.chunk(2, 0) for x in parts]; g = torch.cat([a for a, _ in h] + [b for _, b in h], 0)
        else: g = torch.cat(parts, 0)
        if ".layers." in name:
            a, b = name.split(".layers.", 1); i, rest = b.split(".", 1)
            name = f"{a}.layers.{int(i) + p * layers // pp}.{rest}"
        merged[name] = g.contiguous()
print(len(merged), sum(v.numel() for v in merged.values()))
'''


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "ckptfs"))
    a = ap.parse_args()
    ck = os.path.join(HERE, "out", f"megatron-legacy-tp2-pp2-L{a.layers}-H{a.hidden}")
    if not os.path.exists(os.path.join(ck, "latest_checkpointed_iteration.txt")):
        shutil.rmtree(ck, ignore_errors=True)
        print(f"writing {ck} with megatron-core ...", flush=True)
        subprocess.run([sys.executable, os.path.join(ROOT, "tests", "fixtures", "make_megatron.py"), "legacy", ck,
                        "--tp", "2", "--pp", "2", "--bf16", "--layers", str(a.layers), "--hidden", str(a.hidden),
                        "--ffn", str(4 * a.hidden), "--heads", "16"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(os.path.join(ck, "reference"), ignore_errors=True)
    src = files_under(ck, skip=(".ckptfs", "reference"))
    size = sum(os.path.getsize(f) for f in src)
    print(f"checkpoint: {ck}: {len(src)} files, {size / 2**30:.2f} GiB")

    work = tempfile.mkdtemp(prefix="mg-bench-", dir=os.path.join(HERE, "out"))
    try:
        script = os.path.join(work, "merge.py")
        open(script, "w").write(BASELINE)
        drop_cache(src)
        t_base, r = timed(["/usr/bin/time", "-f", "MAXRSS_KB %M", sys.executable, script, ck, "2", "2",
                           str(a.layers)], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(r.stderr[-3000:])
        rss_base = int(tagged(r.stderr, "MAXRSS_KB")[1])
        print(f"baseline torch.load all ranks + merge: {t_base:.2f} s, peak RSS {rss_base / 1024:.0f} MiB "
              f"({r.stdout.strip()} params/elements)")

        shutil.rmtree(os.path.join(ck, ".ckptfs"), ignore_errors=True)
        mnt = os.path.join(work, "mnt")
        os.makedirs(mnt)
        drop_cache(src)
        t0 = time.perf_counter()
        subprocess.run([a.bin, "mount", ck, mnt], check=True)
        params = os.path.join(mnt, "params")
        largest = max(os.listdir(params), key=lambda n: os.path.getsize(os.path.join(params, n, "param.raw")))
        with open(os.path.join(params, largest, "param.raw"), "rb") as f:
            assert len(f.read(1)) == 1
        t_first = time.perf_counter() - t0
        pid = daemon_pid(mnt)
        try:
            drop_cache(src)
            dst = os.path.join(work, "copy")
            os.makedirs(dst)
            t0 = time.perf_counter()
            total = 0
            for n in os.listdir(params):
                shutil.copyfile(os.path.join(params, n, "param.raw"), os.path.join(dst, n + ".raw"))
                total += os.path.getsize(os.path.join(dst, n + ".raw"))
            t_cp = time.perf_counter() - t0
            hwm = vm_hwm_kib(pid) if pid else -1
        finally:
            subprocess.run([a.bin, "umount", mnt])
        print(f"(a) mount (index build) -> first byte of params/{largest}/param.raw: {t_first:.3f} s   "
              f"ratio baseline/ckptfs = {t_base / t_first:.0f}x")
        print(f"(b) copy every params/*/param.raw ({total / 2**20:.0f} MiB merged model): {t_cp:.2f} s   "
              f"ratio ckptfs/baseline = {t_cp / t_base:.2f}")
        print(f"daemon peak RSS {hwm / 1024:.0f} MiB; baseline {rss_base / 1024:.0f} MiB")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

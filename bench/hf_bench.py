"""hf/ benchmark: a torchtitan Llama 3 checkpoint to Hugging Face safetensors,
ckptfs against torchtitan's own conversion, in one run, cold page cache.

The checkpoint: tests/fixtures/make_torchtitan.py at --dim/--layers (default
dim 1024, 16 layers, 16 heads, 8 KV heads, vocabulary 32000: 246M float32
parameters, 0.98 GB), saved by torchtitan's CheckpointManager.

  * converter: what torchtitan's scripts/checkpoint_conversion/convert_to_hf.py
    does, in a fresh process: build the model's state dict on CPU, dcp.load
    the step into it, Llama3StateDictAdapter.to_hf, safetensors save_file.
    Time from process start to the file written.
  * ckptfs, lookup -> first byte: index build + mount + open hf/'s shard +
    the first 4 KiB (what `from_pretrained` waits for before it reads).
  * ckptfs, full: the same from a fresh index, then `cp` of hf/ to disk
    (the converter's output, file for file).

    python bench/hf_bench.py [--out DIR] [--dim 1024] [--layers 16] [--bin build/ckptfs]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dcp_bench import drop_cache  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONVERT = r'''
import os, sys, time
t0 = time.time()
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
sys.path.insert(0, sys.argv[3])
import make_torchtitan as mt
from torchtitan.models.llama3 import Llama3StateDictAdapter
mt.DIM, mt.N_LAYERS, mt.N_HEADS, mt.N_KV_HEADS, mt.VOCAB = (int(x) for x in sys.argv[4:9])
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[2] + ".store", 1), rank=0, world_size=1)
cfg, _ = mt.model_config("none")
with torch.device("meta"):
    model = cfg.build()
model.to_empty(device="cpu")
sd = model.state_dict()
dcp.load(sd, checkpoint_id=sys.argv[1])
hf = {k: v.contiguous() for k, v in Llama3StateDictAdapter(cfg, None).to_hf(sd).items()}
save_file(hf, sys.argv[2], metadata={"format": "pt"})
print(time.time() - t0)
'''


def files_under(d):
    return [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs]


def wait_mount(mnt, proc):
    while not os.path.ismount(mnt):
        if proc.poll() is not None:
            raise SystemExit(f"mount exited {proc.returncode}")
        time.sleep(0.01)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/ckptfs-hf-bench")
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "ckptfs"))
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    a = ap.parse_args()
    dims = [str(x) for x in (a.dim, a.layers, a.heads, a.kv_heads, a.vocab)]
    src = os.path.join(a.out, "tt")
    step = os.path.join(src, "checkpoint", "step-10")
    fixtures = os.path.join(ROOT, "tests", "fixtures")
    if not os.path.exists(os.path.join(src, "reference", "logits.pt")):
        shutil.rmtree(src, ignore_errors=True)
        subprocess.run([sys.executable, os.path.join(fixtures, "make_torchtitan.py"), src, "--no-verify",
                        "--dim", dims[0], "--layers", dims[1], "--heads", dims[2], "--kv-heads", dims[3],
                        "--vocab", dims[4]], check=True, stdout=subprocess.DEVNULL)
    cfg = os.path.join(src, "reference", "config.json")
    src_bytes = sum(os.path.getsize(p) for p in files_under(step))
    work = os.path.join(a.out, "work")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)

    # Converter, cold.
    drop_cache(files_under(step))
    out_st = os.path.join(work, "converted.safetensors")
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", CONVERT, step, out_st, fixtures] + dims, check=True,
                   stdout=subprocess.DEVNULL, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    t_convert = time.perf_counter() - t

    def ckptfs_run(full):
        ix = os.path.join(work, "ix")
        mnt = os.path.join(work, "mnt")
        shutil.rmtree(ix, ignore_errors=True)
        os.makedirs(mnt, exist_ok=True)
        drop_cache(files_under(step))
        t0 = time.perf_counter()
        subprocess.run([a.bin, "-q", "index", step, "--index", ix], check=True, stdout=subprocess.DEVNULL)
        proc = subprocess.Popen([a.bin, "mount", "-f", step, mnt, "--index", ix, "--hf-config", cfg],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_mount(mnt, proc)
            idx = json.load(open(os.path.join(mnt, "hf", "model.safetensors.index.json")))
            shard = os.path.join(mnt, "hf", sorted(set(idx["weight_map"].values()))[0])
            with open(shard, "rb") as f:
                f.read(4096)
            t_first = time.perf_counter() - t0
            if not full:
                return t_first, None, None
            dest = os.path.join(work, "cp")
            shutil.rmtree(dest, ignore_errors=True)
            subprocess.run(["cp", "-r", os.path.join(mnt, "hf"), dest], check=True)
            t_full = time.perf_counter() - t0
            n = sum(os.path.getsize(p) for p in files_under(dest) if p.endswith(".safetensors"))
            return t_first, t_full, n
        finally:
            subprocess.run(["fusermount3", "-u", mnt], capture_output=True)
            proc.wait(timeout=60)

    t_first, _, _ = ckptfs_run(full=False)
    _, t_full, out_bytes = ckptfs_run(full=True)
    # The same tensors: the converter's file and ckptfs's shard hold the same bytes per tensor.
    from safetensors import safe_open
    dest = os.path.join(work, "cp")
    shard = [p for p in files_under(dest) if p.endswith(".safetensors")]
    with safe_open(out_st, "pt") as ref:
        keys = sorted(ref.keys())
        same = True
        for p in shard:
            with safe_open(p, "pt") as got:
                for k in got.keys():
                    same &= bool((got.get_tensor(k) == ref.get_tensor(k)).all())
    print(json.dumps({
        "checkpoint": step, "source_bytes": src_bytes, "hf_bytes": out_bytes, "tensors": len(keys),
        "converter_s": round(t_convert, 2),
        "ckptfs_lookup_to_first_byte_s": round(t_first, 3),
        "ckptfs_full_copy_s": round(t_full, 2),
        "first_byte_speedup": round(t_convert / t_first, 1),
        "full_copy_ratio": round(t_convert / t_full, 2),
        "identical_tensors": same,
    }, indent=2))


if __name__ == "__main__":
    main()

"""hf/ benchmark for MaxText: a scanned MaxText Llama Orbax checkpoint to Hugging Face
safetensors, ckptfs against a MaxText-style conversion, in one run, cold page cache.

The checkpoint (written once, kept under --out): orbax itself in this venv, the way
MaxText 0.2.5 saves (common/checkpointing.py save_checkpoint): an orbax v1
training.Checkpointer with MaxText's Context (checkpoint_context.build_context:
OCDBT + zarr3, ocdbt_target_data_file_size = chunk_byte_size = 2 GiB, zstd chunks),
save_checkpointables(1, {"items": state}, custom_metadata={"scan_layers": True}),
state = {"params": {"params": ...}} with MaxText's names and shapes (scanned layers
stacked on axis 1; tests/data/orbax_maxtext/llama_tiny/MAPPING.md), float32, random
values, one host CPU device. Default E=1024 L=16 H=16 K=8 D=64 M=2816 V=32000
(246M parameters, 0.98 GB float32). Beside it, the matching HF LlamaConfig config.json.

  * cat: every source file of the step, cold: the read ceiling (source bytes / s).
  * converter: what MaxText's conversion amounts to, in a fresh process: orbax restore
    of the params into host numpy, MAPPING.md's mapping in numpy (layer slice,
    reshape, transpose, q_proj * sqrt(head_dim)), safetensors.numpy.save_file.
    Time from process start to the file written; its peak RSS.
  * ckptfs: fresh index (SRC/.ckptfs removed), mount --hf-config; lookup -> first
    byte (index build + mount + open hf/'s first shard + 4 KiB), then `cp -r` of hf/
    to disk; total time; the daemon's peak RSS (VmHWM before unmounting).
  * the copied shards equal the converter's file, tensor for tensor, bit for bit.

    python bench/maxtext_hf_bench.py [--out DIR] [--emb 1024] [--layers 16] [--heads 16]
        [--kv-heads 8] [--head-dim 64] [--mlp 2816] [--vocab 32000] [--bin build/ckptfs]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dcp_bench import drop_cache, vm_hwm_kib  # noqa: E402
from hf_bench import files_under, wait_mount  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# argv: ROOT(checkpoint manager dir) E L H K D M V
GENERATE = r'''
import os, sys
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import numpy as np, jax
import orbax.checkpoint.experimental.v1 as ocp
root = sys.argv[1]
E, L, H, K, D, M, V = (int(x) for x in sys.argv[2:9])
rng = np.random.default_rng(0)
def w(*shape, fan_in):
    return jax.device_put(rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(fan_in)))
def scale(*shape):
    return jax.device_put(np.float32(1) + np.float32(0.1) * rng.standard_normal(shape, dtype=np.float32))
params = {
    "token_embedder": {"embedding": w(V, E, fan_in=1)},
    "decoder": {
        "decoder_norm": {"scale": scale(E)},
        "logits_dense": {"kernel": w(E, V, fan_in=E)},
        "layers": {
            "self_attention": {
                "query": {"kernel": w(E, L, H, D, fan_in=E * D)},   # MaxText folds 1/sqrt(D) in
                "key": {"kernel": w(E, L, K, D, fan_in=E)},
                "value": {"kernel": w(E, L, K, D, fan_in=E)},
                "out": {"kernel": w(H, L, D, E, fan_in=H * D)},
            },
            "mlp": {"wi_0": {"kernel": w(E, L, M, fan_in=E)}, "wi_1": {"kernel": w(E, L, M, fan_in=E)},
                    "wo": {"kernel": w(M, L, E, fan_in=M)}},
            "pre_self_attention_layer_norm": {"scale": scale(E, L)},
            "post_self_attention_layer_norm": {"scale": scale(E, L)},
        },
    },
}
# MaxText 0.2.5 checkpoint_context.build_context(use_ocdbt=True, use_zarr3=True,
# ocdbt_target_data_file_size_bytes=DEFAULT_OCDBT_TARGET_DATA_FILE_SIZE (2 GiB), ...)
ctx = ocp.Context()
ctx.array.saving.use_ocdbt = True
ctx.array.saving.use_zarr3 = True
ctx.array.saving.ocdbt_target_data_file_size = 2 * 1024**3
ctx.array.saving.storage_options.chunk_byte_size = 2 * 1024**3
with ocp.training.Checkpointer(root, context=ctx) as ckptr:
    ckptr.save_checkpointables(1, {"items": {"params": {"params": params}}}, force=True,
                               custom_metadata={"scan_layers": True})
'''

# argv: STEP_DIR OUT.safetensors E L H K D M V; prints a JSON breakdown (seconds since start).
CONVERT = r'''
import os, sys, time, json
t0 = time.time()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import numpy as np, jax
import orbax.checkpoint as ocp
from etils import epath
from safetensors.numpy import save_file
t_import = time.time() - t0
item = epath.Path(sys.argv[1]) / "items"
E, L, H, K, D, M, V = (int(x) for x in sys.argv[3:10])
tree = ocp.PyTreeCheckpointHandler().metadata(item).tree
restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
r = ocp.PyTreeCheckpointer().restore(item, args=ocp.args.PyTreeRestore(item=tree, restore_args=restore_args))
t_restore = time.time() - t0
p = r["params"]["params"]
dec, lay = p["decoder"], p["decoder"]["layers"]
att, mlp = lay["self_attention"], lay["mlp"]
c = np.ascontiguousarray
sqrt_d = np.float32(np.sqrt(D))
hf = {"model.embed_tokens.weight": c(p["token_embedder"]["embedding"]),
      "model.norm.weight": c(dec["decoder_norm"]["scale"]),
      "lm_head.weight": c(dec["logits_dense"]["kernel"].T)}
for l in range(L):
    a = f"model.layers.{l}."
    hf[a + "self_attn.q_proj.weight"] = c((att["query"]["kernel"][:, l] * sqrt_d).reshape(E, H * D).T)
    hf[a + "self_attn.k_proj.weight"] = c(att["key"]["kernel"][:, l].reshape(E, K * D).T)
    hf[a + "self_attn.v_proj.weight"] = c(att["value"]["kernel"][:, l].reshape(E, K * D).T)
    hf[a + "self_attn.o_proj.weight"] = c(att["out"]["kernel"][:, l].reshape(H * D, E).T)
    hf[a + "mlp.gate_proj.weight"] = c(mlp["wi_0"]["kernel"][:, l].T)
    hf[a + "mlp.up_proj.weight"] = c(mlp["wi_1"]["kernel"][:, l].T)
    hf[a + "mlp.down_proj.weight"] = c(mlp["wo"]["kernel"][:, l].T)
    hf[a + "input_layernorm.weight"] = c(lay["pre_self_attention_layer_norm"]["scale"][:, l])
    hf[a + "post_attention_layernorm.weight"] = c(lay["post_self_attention_layer_norm"]["scale"][:, l])
t_map = time.time() - t0
save_file(hf, sys.argv[2], metadata={"format": "pt"})
t_save = time.time() - t0
print(json.dumps({"import_s": t_import, "restore_s": t_restore - t_import, "map_s": t_map - t_restore,
                  "save_s": t_save - t_map, "in_process_s": t_save, "tensors": len(hf)}))
'''


def run_rusage(args, **kw):
    """Runs args to completion; returns (seconds, stdout, peak RSS KiB of that child alone)."""
    t = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, **kw)
    out = proc.stdout.read()
    _, status, ru = os.wait4(proc.pid, 0)
    dt = time.perf_counter() - t
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{args[:3]} exited {proc.returncode}")
    return dt, out.decode(), ru.ru_maxrss


def cpu_s(pid):
    """User and system CPU seconds of a live process (/proc/PID/stat utime, stime)."""
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    hz = os.sysconf("SC_CLK_TCK")
    return int(f[11]) / hz, int(f[12]) / hz


def hf_config(a):
    return {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "head_dim": a.head_dim, "hidden_act": "silu",
        "hidden_size": a.emb, "initializer_range": 0.02, "intermediate_size": a.mlp,
        "max_position_embeddings": 2048, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": a.heads, "num_hidden_layers": a.layers, "num_key_value_heads": a.kv_heads,
        "pad_token_id": None, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": True, "vocab_size": a.vocab,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/ckptfs-bench-maxtext")
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "ckptfs"))
    ap.add_argument("--emb", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--mlp", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    a = ap.parse_args()
    dims = [str(x) for x in (a.emb, a.layers, a.heads, a.kv_heads, a.head_dim, a.mlp, a.vocab)]
    env = dict(os.environ, PYTHONWARNINGS="ignore", JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
    base = os.path.join(a.out, "maxtext-" + "-".join(dims))
    src = os.path.join(base, "checkpoints")          # the CheckpointManager root: what is mounted
    step = os.path.join(src, "1")
    cfg = os.path.join(base, "config.json")
    t_gen = None
    if not os.path.exists(os.path.join(step, "commit_success.txt")):
        shutil.rmtree(base, ignore_errors=True)
        os.makedirs(base)
        print(f"writing the MaxText checkpoint with orbax ({' '.join(dims)}) ...", file=sys.stderr, flush=True)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", GENERATE, src] + dims, check=True, env=env,
                       stdout=subprocess.DEVNULL)
        t_gen = time.perf_counter() - t
    with open(cfg, "w") as f:
        json.dump(hf_config(a), f, indent=2)
    shutil.rmtree(os.path.join(src, ".ckptfs"), ignore_errors=True)
    sources = files_under(step)
    src_bytes = sum(os.path.getsize(p) for p in sources)
    work = os.path.join(a.out, "work")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)

    # Ceiling: cat of every source file, cold.
    drop_cache(sources)
    t = time.perf_counter()
    subprocess.run(["cat"] + sources, check=True, stdout=subprocess.DEVNULL)
    t_cat = time.perf_counter() - t

    # Converter, cold, fresh process.
    drop_cache(sources)
    out_st = os.path.join(work, "converted.safetensors")
    t_convert, out, rss_convert = run_rusage([sys.executable, "-c", CONVERT, step, out_st] + dims, env=env)
    breakdown = json.loads(out.strip().splitlines()[-1])

    # ckptfs: fresh index, cold, mount, first byte, cp -r hf/.
    shutil.rmtree(os.path.join(src, ".ckptfs"), ignore_errors=True)
    mnt = os.path.join(work, "mnt")
    dest = os.path.join(work, "cp")
    os.makedirs(mnt)
    drop_cache(sources)
    log = open(os.path.join(work, "mount.log"), "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen([a.bin, "mount", "-f", src, mnt, "--hf-config", cfg], stdout=log, stderr=log)
    try:
        wait_mount(mnt, proc)
        t_mounted = time.perf_counter() - t0
        idx = json.load(open(os.path.join(mnt, "hf", "model.safetensors.index.json")))
        shard = os.path.join(mnt, "hf", sorted(set(idx["weight_map"].values()))[0])
        with open(shard, "rb") as f:
            f.read(4096)
        t_first = time.perf_counter() - t0
        subprocess.run(["cp", "-r", os.path.join(mnt, "hf"), dest], check=True)
        t_full = time.perf_counter() - t0
        rss_daemon = vm_hwm_kib(proc.pid)
        cpu_daemon = cpu_s(proc.pid)
        errors = open(os.path.join(mnt, "hf", "ERRORS")).read()
    finally:
        subprocess.run(["fusermount3", "-u", mnt], capture_output=True)
        proc.wait(timeout=60)
        log.close()
    shards = sorted(p for p in files_under(dest) if p.endswith(".safetensors"))
    hf_bytes = sum(os.path.getsize(p) for p in shards)

    # The same tensors, bit for bit.
    import numpy as np
    from safetensors import safe_open
    mismatches = []
    with safe_open(out_st, "numpy") as ref:
        want = set(ref.keys())
        got = set()
        for p in shards:
            with safe_open(p, "numpy") as g:
                for k in g.keys():
                    got.add(k)
                    x = g.get_tensor(k)
                    if k not in want:
                        continue
                    y = ref.get_tensor(k)
                    if x.shape != y.shape or x.dtype != y.dtype or not np.array_equal(x.view(np.uint32),
                                                                                     y.view(np.uint32)):
                        d = x.view(np.uint32) != y.view(np.uint32) if (x.shape, x.dtype) == (y.shape, y.dtype) else None
                        zeros = d is not None and bool(((x[d] == 0) & (y[d] == 0)).all())
                        mismatches.append(f"{k}: " + ("shape/dtype" if d is None else f"{int(d.sum())} elements"
                                                      + (" (+0 vs -0 only)" if zeros else "")))
    mismatches += [f"missing {k}" for k in sorted(want - got)] + [f"extra {k}" for k in sorted(got - want)]
    if mismatches or errors:
        print(f"!!! MISMATCH: {len(mismatches)} tensors differ from the converter's: {mismatches[:10]}; "
              f"hf/ERRORS: {errors!r}", file=sys.stderr, flush=True)

    cat_gbs = src_bytes / t_cat / 1e9
    ckptfs_gbs = hf_bytes / t_full / 1e9
    print(json.dumps({
        "checkpoint": step, "dims": " ".join(f"{n}={v}" for n, v in zip("ELHKDMV", dims)),
        "generate_s": None if t_gen is None else round(t_gen, 1),
        "source_bytes": src_bytes, "source_files": len(sources), "hf_bytes": hf_bytes, "hf_shards": len(shards),
        "tensors": len(want),
        "cat_s": round(t_cat, 2), "cat_GBps": round(cat_gbs, 3),
        "converter_s": round(t_convert, 2),
        "converter_breakdown_s": {k: round(v, 2) for k, v in breakdown.items() if k.endswith("_s")},
        "converter_peak_rss_MiB": round(rss_convert / 1024),
        "ckptfs_mount_live_s": round(t_mounted, 3),
        "ckptfs_lookup_to_first_byte_s": round(t_first, 3),
        "ckptfs_full_copy_s": round(t_full, 2), "ckptfs_GBps": round(ckptfs_gbs, 3),
        "ckptfs_daemon_peak_rss_MiB": round(rss_daemon / 1024),
        "ckptfs_daemon_cpu_s": {"user": round(cpu_daemon[0], 1), "sys": round(cpu_daemon[1], 1)},
        "ratios": {
            "ckptfs_full_over_converter": round(t_full / t_convert, 3),
            "converter_over_ckptfs_first_byte": round(t_convert / t_first, 1),
            "ckptfs_GBps_over_cat_GBps": round(ckptfs_gbs / cat_gbs, 3),
            "converter_rss_over_ckptfs_rss": round(rss_convert / max(rss_daemon, 1), 2),
        },
        "identical_tensors": not mismatches and not errors,
        "mismatches": mismatches[:20], "hf_errors": errors,
    }, indent=2))


if __name__ == "__main__":
    main()

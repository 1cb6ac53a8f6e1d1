#!/usr/bin/env python3
"""Packs real producer checkpoints into seed inputs for the directory fuzz
targets (format: tests/fuzz/dir_harness.h). Sources are the committed data
(tests/data) and the integration fixtures the producers write
(build/fixtures, made by `scripts/test.sh` or the integration tests), plus one
DCP checkpoint torch writes here with hostile names (a lone surrogate, a
4,000-byte name, '..', '/'). Files over --max-file bytes are left out (their
tensors become missing-file cases, which the readers must handle too), so a
seed stays small. Re-run after a fixture format change; commit the result.

    .venv/bin/python tests/fuzz/make_corpus.py [--fixtures build/fixtures] [--out tests/fuzz/corpus]
"""
import argparse
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HOSTILE = r'''
import sys, torch, torch.distributed.checkpoint as dcp
sd = {"w\udcff.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
      "layers.0." + "x" * 4000: torch.ones(4), "layers.1/../..": torch.zeros(2, 2),
      "": torch.ones(1), "layers.2.ok.weight": torch.full((2, 2), 7.0, dtype=torch.bfloat16)}
dcp.save(sd, checkpoint_id=sys.argv[1])
'''


def pack(src, max_file, skip=()):
    out = bytearray()
    for root, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if d not in (".ckptfs", "reference"))
        for f in sorted(files):
            p = Path(root) / f
            rel = p.relative_to(src).as_posix()
            if any(rel.endswith(s) for s in skip) or p.stat().st_size > max_file:
                continue
            name, data = rel.encode(), p.read_bytes()
            out += struct.pack("<H", len(name)) + name + struct.pack("<I", len(data)) + data
    return bytes(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default=str(ROOT / "build" / "fixtures"))
    ap.add_argument("--out", default=str(ROOT / "tests" / "fuzz" / "corpus"))
    a = ap.parse_args()
    fx, data = Path(a.fixtures), ROOT / "tests" / "data"
    with tempfile.TemporaryDirectory() as tmp:
        hostile = Path(tmp) / "hostile"
        subprocess.run([sys.executable, "-c", HOSTILE, str(hostile)], check=True, capture_output=True)
        seeds = {
            "dcp_dir": [(data / "dcp_single", 300_000, ()), (data / "dcp_torch113", 300_000, ()),
                        (fx / "zstd", 300_000, ()), (fx / "dtensor_dim1_w2", 300_000, ()),
                        (fx / "fsdp2_bf16_w2", 300_000, ()),
                        # DCP's other layouts (and safetensors directories, which the
                        # same harness detects): rank-local, SAFETENSORS items, HF storage.
                        (fx / "ranklocal_w2", 300_000, ()), (fx / "st_format_w2", 300_000, ()),
                        (fx / "hf_sharded_w2", 300_000, ()), (fx / "hf_storage_w2", 300_000, ()),
                        (data / "verl_fsdp2" / "global_step_1" / "actor", 300_000, ()),
                        # Per-rank ShardedTensor files (Accelerate, FSDP1) and torch 2.0's DCP.
                        (data / "accelerate_fsdp1_rank", 300_000, ()),
                        (data / "verl_hsdp" / "global_step_1" / "actor", 300_000, ()),
                        (data / "meta_llama_mp2" / "mp2", 300_000, ()),
                        (data / "dcp_torch2x" / "2.0.1" / "ckpt", 300_000, ())],
            "deepspeed_dir": [(data / "ds_py3112" / "padspan_z2_dp4", 300_000, ()),
                              (data / "ds_py3112" / "z1_fp32_dp1", 300_000, ()),
                              # DeepSpeed 0.15's MoE: no param_shapes, expp_rank files.
                              (data / "ds_py3112" / "moe_z2_bf16_dp2_ep2", 300_000, ()),
                              (fx / "deepspeed_moe" / "dp2_ep2_s2_fp32", 300_000, ()),
                              (fx / "deepspeed_pipe" / "pp2_dp2_fp32", 300_000, ())],
            "megatron_legacy_dir": [(fx / "megatron" / "legacy_tp1_pp1", 1_200_000, ())],
            "megatron_dist_dir": [(fx / "megatron" / "dist_tp2_pp2_dp2", 1_000_000, (".distcp",)),
                                  (fx / "megatron" / "dist_moe_dpreshard_tp2_pp2_ep2", 1_000_000, (".distcp",)),
                                  (fx / "megatron" / "zarr_tp2_pp2", 100_000, ())],
            "views": [(hostile, 300_000, ()), (data / "ds_py3112" / "padspan_z2_dp4", 300_000, ())],
            # Orbax (committed saves of orbax-checkpoint): OCDBT with every value inline
            # (bf16), zarr v3 shards, two processes' databases merged, plain zarr v3 dirs.
            "orbax_dir": [(data / "orbax" / "v0_bf16" / "ckpt", 300_000, ()),
                          (data / "orbax" / "v0_zarr3" / "ckpt" / "2", 300_000, ()),
                          (data / "orbax" / "multiprocess" / "ckpt" / "2" / "default", 300_000, ()),
                          (data / "orbax" / "no_ocdbt_zarr3" / "ckpt" / "2" / "default", 300_000, ())],
        }
        # The OCDBT parser alone (fuzz_ocdbt): one database directory each.
        seeds_ocdbt = [data / "orbax" / "v0_bf16" / "ckpt" / "2" / "default",
                       data / "orbax" / "multiprocess" / "ckpt" / "2" / "default" / "ocdbt.process_1",
                       data / "orbax" / "v1" / "ckpt" / "2" / "state"]
        for target, srcs in seeds.items():
            d = Path(a.out) / target
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
            used = set()
            for src, max_file, skip in srcs:
                if not src.is_dir():
                    sys.exit(f"{src}: not found (run the integration tests once to write build/fixtures)")
                blob = pack(src, max_file, skip)
                name = f"{src.parent.name}_{src.name}.bin"
                if "orbax" in src.parts:  # tests/data/orbax/<fixture>/ckpt/...
                    name = f"orbax_{src.parts[src.parts.index('orbax') + 1]}.bin"
                if name in used:  # verl_fsdp2 and verl_hsdp both end in global_step_1/actor
                    name = f"{src.parents[1].name}_{name}"
                used.add(name)
                (d / name).write_bytes(blob)
                print(f"{target}: {src.name} {len(blob)} bytes")
        d = ROOT / "tests" / "fuzz" / "ocdbt_seeds"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        for src in seeds_ocdbt:
            blob = pack(src, 300_000, ("_METADATA", "_sharding", "commit_success.txt"))
            (d / f"{src.parts[src.parts.index('orbax') + 1]}_{src.name}.bin").write_bytes(blob)
            print(f"ocdbt: {src} {len(blob)} bytes")


if __name__ == "__main__":
    main()

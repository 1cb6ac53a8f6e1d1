"""--gpu=auto|on|off through real mounts and the CLI.

Every mode must serve the same bytes: DCP checkpoints written by torch whose
views need merges (FSDP2 shards, dim-1 DTensor shards interleaved row by row)
and bf16 -> float32 widening (.npy views) are mounted once per mode and
compared file by file with `cmp` and numpy. Where no CUDA device exists,
`--gpu=on` must refuse with the reason and the on-mode mounts are skipped;
`auto` then runs on the CPU and says so in the mount log.
"""
import json
import subprocess

import numpy as np
import pytest

from conftest import run

SCENARIOS = ["fsdp2_bf16_w2", "dtensor_dim1_w4"]


def gpu_present(bin_path, src):
    r = run([bin_path, "ls", str(src), "--gpu=on"])
    return r.returncode == 0, r


def data_files(root):
    out = []
    for p in sorted((root / "params").rglob("*")):
        if p.is_file() and p.suffix in (".npy", ".pt", ".bin"):
            out.append(p.relative_to(root))
    return out


def test_gpu_on_without_a_device_is_a_clear_error(dcp_fixtures, bin_path):
    present, r = gpu_present(bin_path, dcp_fixtures / "fsdp2_bf16_w2")
    if present:
        pytest.skip("a CUDA device is present: --gpu=on is valid here")
    assert r.returncode != 0
    assert "--gpu=on" in r.stderr and "CUDA" in r.stderr, r.stderr
    bad = run([bin_path, "ls", str(dcp_fixtures / "fsdp2_bf16_w2"), "--gpu=sometimes"])
    assert bad.returncode == 2 and "{auto,on,off}" in bad.stderr, bad.stderr


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_mode_serves_the_same_bytes(scenario, dcp_fixtures, bin_path, mounter, tmp_path):
    src = dcp_fixtures / scenario
    present, _ = gpu_present(bin_path, src)
    modes = ["off", "auto"] + (["on"] if present else [])
    mounts = {}
    try:
        for mode in modes:
            cm = mounter(src, name=f"mnt_{mode}", extra=["--gpu", mode])
            mounts[mode] = (cm, cm.__enter__())
        off = mounts["off"][1]
        assert "transforms cpu" in off.log_text()
        if not present:
            assert "transforms cpu" in mounts["auto"][1].log_text()
        files = data_files(off.path)
        assert any(f.suffix == ".npy" for f in files)
        for mode in modes[1:]:
            m = mounts[mode][1]
            for f in files:
                c = subprocess.run(["cmp", str(off.path / f), str(m.path / f)], capture_output=True, text=True)
                assert c.returncode == 0, f"{mode}: {f}: {c.stdout}{c.stderr}"
                if f.suffix == ".npy":
                    a, b = np.load(off.path / f), np.load(m.path / f)
                    assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
        # A copy made through the GPU mount equals one made through the CPU mount.
        if present:
            f = files[0]
            subprocess.run(["cp", str(mounts["on"][1].path / f), str(tmp_path / "gpu.copy")], check=True)
            subprocess.run(["cmp", str(off.path / f), str(tmp_path / "gpu.copy")], check=True)
    finally:
        for cm, _ in reversed(list(mounts.values())):
            cm.__exit__(None, None, None)


def crc32c(data: bytes) -> int:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    c = 0xFFFFFFFF
    for b in data:
        c = (c >> 8) ^ table[(c ^ b) & 0xFF]
    return c ^ 0xFFFFFFFF


def test_verify_crc32c_is_the_crc_of_the_tensor_bytes(dcp_fixtures, bin_path, mounter):
    """verify's per-tensor CRC-32C (computed on the transforms backend) is the
    CRC-32C of the raw bytes numpy reads from the mount."""
    src = dcp_fixtures / "fsdp2_w3"
    r = run([bin_path, "verify", str(src), "--json"])
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    with mounter(src) as m:
        checked = 0
        for t in rep["tensors"]:
            if not (t.get("fqn") and t.get("state") and t.get("read")):
                continue
            p = m.path / "params" / t["fqn"] / f"{t['state']}.npy"
            if not p.exists():
                continue
            a = np.load(p)
            if a.nbytes > (1 << 20) or a.dtype != np.float32:
                continue
            assert t["crc32c"] == f"{crc32c(np.ascontiguousarray(a).tobytes()):08x}", t["key"]
            checked += 1
        assert checked >= 4

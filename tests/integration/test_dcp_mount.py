"""PyTorch DCP through a real ckptfs mount, checked with real clients: numpy,
torch, cmp, cp, diff. References come from torch itself
(torch.distributed.checkpoint.format_utils.dcp_to_torch_save)."""
import errno
import filecmp
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import ROOT, ckptfs_bin, run

SCENARIOS = ["single", "replicated_w2", "fsdp2_w3", "fsdp2_bf16_w2", "dtensor_dim0_w2", "dtensor_dim0_w4", "dtensor_dim1_w2", "dtensor_dim1_w4", "zstd"]


def flatten(obj, prefix=""):
    """The DCP flat keys of a nested state dict (dict keys and list indices joined by '.')."""
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(obj, list) and any(isinstance(v, (torch.Tensor, dict, list)) for v in obj):
        for i, v in enumerate(obj):
            out.update(flatten(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = obj
    return out


def reference(src, tmp_path):
    out = tmp_path / "ref.pt"
    dcp_to_torch_save(str(src), str(out))
    return flatten(torch.load(out, weights_only=False))


def view_path(key, tensor):
    if not isinstance(tensor, torch.Tensor):
        return f"other/{key}", None
    if key.startswith("model."):
        return f"params/{key[len('model.'):]}/param.npy", f"params/{key[len('model.'):]}/param.raw"
    if key.startswith("optimizer.state."):
        fqn, state = key[len("optimizer.state."):].rsplit(".", 1)
        return f"params/{fqn}/{state}.npy", f"params/{fqn}/{state}.raw"
    if "." not in key or key.startswith(("extra.",)) or key in ("half", "ids"):
        return f"other/{key}.npy", f"other/{key}.raw"
    return f"params/{key}/param.npy", f"params/{key}/param.raw"


def expected_npy(t):
    if t.dtype == torch.bfloat16 or str(t.dtype).startswith("torch.float8"):
        return t.float().numpy()
    return t.numpy()


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_tensor_equals_what_torch_loads(scenario, dcp_fixtures, mounter, tmp_path):
    src = dcp_fixtures / scenario
    if not (src / ".metadata").exists():
        pytest.skip(f"{scenario} not produced by this torch")
    ref = reference(src, tmp_path)
    work = tmp_path / "raw"
    work.mkdir()
    with mounter(src, index=tmp_path / "index") as m:
        n_tensors = 0
        for key, val in ref.items():
            npy, raw = view_path(key, val)
            if scenario == "zstd" and isinstance(val, torch.Tensor):
                npy, raw = f"params/{key}/param.npy", f"params/{key}/param.raw"
            p = m.path / npy
            assert p.exists(), f"{key} -> {npy} missing"
            if raw is None:  # bytes entry: a torch.save blob, loadable as is
                assert torch.load(p, weights_only=False) == val, key
                continue
            n_tensors += 1
            got = np.load(p)
            want = expected_npy(val)
            assert got.dtype == want.dtype and got.shape == want.shape, key
            np.testing.assert_array_equal(got, want, err_msg=key)
            # .raw twin: the exact source bytes, compared with cmp(1).
            ref_raw = work / (key + ".bin")
            ref_raw.write_bytes(val.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if val.numel() else b"")
            r = subprocess.run(["cmp", str(ref_raw), str(m.path / raw)], capture_output=True, text=True)
            assert r.returncode == 0, f"{key}: {r.stdout}{r.stderr}"
            assert os.stat(m.path / raw).st_size == val.numel() * val.element_size()
        assert n_tensors > 0
        assert "error" not in m.log_text().lower()


def test_torch113_checkpoint(mounter, tmp_path):
    src = tmp_path / "ckpt"
    shutil.copytree(ROOT / "tests/data/dcp_torch113/ckpt", src)
    want = np.load(ROOT / "tests/data/dcp_torch113/expected.npz")
    with mounter(src) as m:
        np.testing.assert_array_equal(np.load(m.path / "params/model.w/param.npy"), want["w"])
        np.testing.assert_array_equal(np.load(m.path / "params/model.bf/param.npy"), want["bf"])
        np.testing.assert_array_equal(np.load(m.path / "params/model.bias/param.npy"), want["bias"])
        assert torch.load(m.path / "other/step", weights_only=False) == 42
        info = (m.path / "checkpoint.json").read_text()
        assert "1.13" in info and '"step": 42' in info
    assert (src / ".ckptfs" / "index").is_dir()  # default location in a writable checkpoint


TORCH2X = ROOT / "tests/data/dcp_torch2x"


@pytest.mark.parametrize("version", sorted((p.name for p in TORCH2X.iterdir() if p.is_dir()),
                                           key=lambda v: tuple(int(x) for x in v.split("."))))
def test_dcp_written_by_every_torch2x_release(version, mounter, tmp_path):
    """tests/data/dcp_torch2x/<version>: the same 2-rank state (DTensor or,
    where that release's DCP refuses DTensors, ShardedTensor parameters; AdamW
    moments; int64, bf16, replicated and uneven tensors; bytes entries) saved by
    each torch 2.x release under Debian 12's CPython 3.11.2
    (tests/fixtures/make_dcp_torch2x.sh). Every tensor's .raw is the exact
    bytes the producer held, every optimizer state sits under its parameter,
    and every bytes entry loads with torch to what was saved."""
    d = TORCH2X / version
    exp = json.loads((d / "expected.json").read_text())
    want = np.load(d / "expected.npz")
    assert exp["features"]["torch"].startswith(version)
    src = tmp_path / "ckpt"
    shutil.copytree(d / "ckpt", src)
    r = run([ckptfs_bin(), "verify", str(src), "--index", str(tmp_path / "ix")])
    assert r.returncode == 0, r.stdout + r.stderr
    with mounter(src, index=tmp_path / "ix") as m:
        n_states = 0
        for key, t in exp["tensors"].items():
            if key.startswith("model."):
                rel = f"params/{key[len('model.'):]}/param"
            elif key.startswith("optim.state."):
                fqn, state = key[len("optim.state."):].rsplit(".", 1)
                rel = f"params/{fqn}/{state}"
                n_states += 1
            else:
                rel = f"other/{key}"
            got = (m.path / (rel + ".raw")).read_bytes()
            assert got == want[key].tobytes(), f"{version} {key} -> {rel}.raw"
            arr = np.load(m.path / (rel + ".npy"))
            assert list(arr.shape) == t["shape"], key
        assert n_states == 6  # exp_avg, exp_avg_sq, step of both trained parameters
        # Bytes entries: whatever granularity the release's planner kept
        # (2.0 saves nested dicts whole), each flattens to what was saved.
        seen = {}
        for f in (m.path / "other").iterdir():
            if f.suffix in (".npy", ".raw"):
                continue
            obj = torch.load(f, weights_only=False)
            seen.update({k: repr(v) for k, v in flatten(obj, f.name + ".").items()} if isinstance(obj, (dict, list))
                        else {f.name: repr(obj)})
        for key, val in exp["others"].items():
            assert seen.get(key) == val, (version, key, seen)
        info = json.loads((m.path / "checkpoint.json").read_text())
        assert info["step"] == 7 and info["family"] == "pytorch-dcp", info
        # What the .metadata itself shows of its release: planner_data only
        # (2.0-2.3), storage_meta (2.4+), a version field (2.9+).
        v = tuple(int(x) for x in version.split(".")[:2])
        assert ("(torch 2.0-2.3)" if v < (2, 4) else "(torch >= 2.4)") in info["format"], info["format"]
        assert ("version 1.0.0" in info["format"]) == (v >= (2, 9)), info["format"]
        assert "error" not in m.log_text().lower()


def test_cp_r_and_diff_of_two_mounts(dcp_fixtures, mounter, tmp_path):
    src = dcp_fixtures / "dtensor_dim1_w4"
    with mounter(src, "a", index=tmp_path / "ix") as a, mounter(src, "b", index=tmp_path / "ix") as b:
        dst = tmp_path / "copy"
        subprocess.run(["cp", "-r", str(a.path / "params"), str(dst)], check=True, timeout=120)
        cmp = filecmp.dircmp(a.path / "params", dst)
        assert not cmp.left_only and not cmp.right_only
        for d in (a.path / "params").iterdir():
            for f in d.iterdir():
                assert filecmp.cmp(f, dst / d.name / f.name, shallow=False), f
        r = subprocess.run(["diff", "-r", str(a.path), str(b.path)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout == "", r.stdout


@pytest.mark.parametrize("scenario", ["dtensor_dim1_w4", "fsdp2_bf16_w2"])
def test_mapped_and_copied_replies_are_the_same_bytes(scenario, dcp_fixtures, mounter, tmp_path):
    """Reads that are plain copies of source bytes (here rows merged from 4
    dim-1 shards, and FSDP2 dim-0 shards) are answered from mappings of the
    shards by default and through the read engine with --mapped-reads off:
    diff -r of the two trees finds nothing. The .npy files of the bf16 run
    are widened to float32: converted straight from the mappings by default,
    through the engine with --mapped-reads off."""
    src = dcp_fixtures / scenario
    with mounter(src, name="mapped", index=tmp_path / "index") as a, \
            mounter(src, name="copied", index=tmp_path / "index", extra=["--mapped-reads", "off"]) as b:
        r = run(["diff", "-r", str(a.path / "params"), str(b.path / "params")], timeout=300)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        stats = [json.loads((m.path / ".ckptfs" / "stats").read_text()) for m in (a, b)]
        for st in stats:
            assert st["bytes"] > 0 and st["source_bytes_read"] > 0 and st["errors"] == 0, st
        assert stats[0]["mapped_reads"] > 0 and stats[1]["mapped_reads"] == 0, stats
        assert stats[1]["mapped_conversions"] == 0, stats
        if scenario == "fsdp2_bf16_w2":
            assert stats[0]["mapped_conversions"] > 0, stats
        # Directories advertise a 4 KiB block (readdir buffers), files 1 MiB (reads).
        assert os.stat(a.path / "params").st_blksize == 4096
        assert os.stat(next((a.path / "params").rglob("*.raw"))).st_blksize == 1 << 20


def test_diff_of_two_steps_lists_exactly_the_changed_tensors(dcp_fixtures, mounter, tmp_path):
    ra = reference(dcp_fixtures / "steps_a", tmp_path / "a_") if (tmp_path / "a_").mkdir() is None else None
    rb = reference(dcp_fixtures / "steps_b", tmp_path / "b_") if (tmp_path / "b_").mkdir() is None else None
    changed = set()
    for key, va in ra.items():
        if not isinstance(va, torch.Tensor):
            continue
        npy, raw = view_path(key, va)
        if not torch.equal(va, rb[key]):
            changed.update({npy, raw, str(Path(npy).parent / "info.json")})
    assert "params/norm.weight/param.npy" not in changed  # frozen: same in both steps
    assert changed
    with mounter(dcp_fixtures / "steps_a", "a", index=tmp_path / "ia") as a, \
            mounter(dcp_fixtures / "steps_b", "b", index=tmp_path / "ib") as b:
        r = subprocess.run(["diff", "-rq", str(a.path / "params"), str(b.path / "params")],
                           capture_output=True, text=True, timeout=120)
        listed = set()
        for line in r.stdout.splitlines():
            assert line.startswith("Files "), line
            left = line.split(" ")[1]
            listed.add(str(Path(left).relative_to(a.path)))
        assert listed == changed


def test_cli_cat_equals_mount_bytes(dcp_fixtures, mounter, tmp_path):
    src = dcp_fixtures / "dtensor_dim0_w4"
    out = tmp_path / "cat.npy"
    with open(out, "wb") as f:
        r = subprocess.run([ckptfs_bin(), "cat", str(src), "proj.weight", "--index", str(tmp_path / "ix")],
                           stdout=f, stderr=subprocess.PIPE, timeout=120)
    assert r.returncode == 0, r.stderr
    raw = tmp_path / "cat.raw"
    with open(raw, "wb") as f:
        subprocess.run([ckptfs_bin(), "cat", str(src), "optimizer.state.proj.weight.exp_avg", "--format", "raw",
                        "--index", str(tmp_path / "ix")], stdout=f, check=True, timeout=120)
    with mounter(src, index=tmp_path / "ix") as m:
        assert filecmp.cmp(out, m.path / "params/proj.weight/param.npy", shallow=False)
        assert filecmp.cmp(raw, m.path / "params/proj.weight/exp_avg.raw", shallow=False)


def test_writes_are_erofs(dcp_fixtures, mounter, tmp_path):
    with mounter(dcp_fixtures / "single", index=tmp_path / "ix") as m:
        for op in (lambda: open(m.path / "params/proj.weight/param.npy", "r+b"),
                   lambda: open(m.path / "new.txt", "w"),
                   lambda: os.mkdir(m.path / "d"),
                   lambda: os.unlink(m.path / "README.txt")):
            with pytest.raises(OSError) as e:
                op()
            assert e.value.errno == errno.EROFS


def test_daemon_mode_and_umount(dcp_fixtures, tmp_path):
    from conftest import fuse_usable
    if not fuse_usable():
        pytest.skip("no usable /dev/fuse")
    mnt = tmp_path / "d"
    mnt.mkdir()
    r = run([ckptfs_bin(), "mount", str(dcp_fixtures / "single"), str(mnt), "--index", str(tmp_path / "ix"),
             "--log", str(tmp_path / "daemon.log")])
    try:
        assert r.returncode == 0, r.stderr
        assert os.path.ismount(mnt)
        assert np.load(mnt / "params/proj.weight/param.npy").shape == (10, 6)
    finally:
        u = run([ckptfs_bin(), "umount", str(mnt)])
    assert u.returncode == 0, u.stderr
    assert not os.path.ismount(mnt)
    # A mount onto a missing directory fails in the parent with a clear message.
    bad = run([ckptfs_bin(), "mount", str(dcp_fixtures / "single"), str(tmp_path / "nope"), "--index",
               str(tmp_path / "ix"), "--log", str(tmp_path / "d2.log")])
    assert bad.returncode != 0 and "cannot mount" in bad.stderr


def test_mount_over_a_mount_is_refused(dcp_fixtures, mounter, tmp_path):
    """A second mount on a live mountpoint, or on a dead one (its daemon
    killed: ENOTCONN), is refused with the command that cleans it, never
    stacked."""
    src = dcp_fixtures / "single"
    with mounter(src, index=tmp_path / "ix") as m:
        r = run([ckptfs_bin(), "mount", str(src), str(m.path), "--index", str(tmp_path / "ix2"),
                 "--log", str(tmp_path / "second.log")], timeout=60)
        assert r.returncode == 1 and "already a mount point" in r.stderr and "ckptfs umount" in r.stderr, r.stderr
        m.proc.kill()  # the daemon dies; the kernel mount stays, dead
        m.proc.wait(timeout=30)
        with pytest.raises(OSError) as e:
            os.listdir(m.path)
        assert e.value.errno == errno.ENOTCONN
        r = run([ckptfs_bin(), "mount", str(src), str(m.path), "--index", str(tmp_path / "ix2"),
                 "--log", str(tmp_path / "third.log")], timeout=60)
        assert r.returncode == 1 and "dead FUSE mount" in r.stderr and f"fusermount3 -u {m.path}" in r.stderr, r.stderr
    v = run([ckptfs_bin(), "--version"])
    assert v.returncode == 0 and v.stdout.startswith("ckptfs ")

"""Damaged checkpoints: the CLI exits non-zero with "cannot <verb> <file>:
<reason>"; a mount serves every intact file and answers EIO (with a log line)
only for what is damaged; a source changed under a running mount answers
ESTALE, and the next mount rebuilds the index."""
import errno
import json
import subprocess
import sys
import os
import shutil
import time

import numpy as np
import pytest

from conftest import ckptfs_bin, run

INTACT = "params/proj.weight/param.npy"


@pytest.fixture
def ck(dcp_fixtures, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(dcp_fixtures / "dtensor_dim0_w2", dst, ignore=shutil.ignore_patterns(".ckptfs"))
    return dst


def read_all(p):
    with open(p, "rb") as f:
        return f.read()


def errno_of(p):
    try:
        read_all(p)
    except OSError as e:
        return e.errno
    return 0


def broken_and_intact(mnt):
    """Reads every params/ and other/ file: (files that gave EIO, files that read)."""
    bad, good = [], []
    for root, _, files in os.walk(mnt):
        for f in files:
            p = os.path.join(root, f)
            (bad if errno_of(p) == errno.EIO else good).append(os.path.relpath(p, mnt))
    return bad, good


def test_truncated_distcp(ck, mounter, tmp_path):
    f = ck / "__1_0.distcp"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    r = run([ckptfs_bin(), "info", str(ck), "--index", str(tmp_path / "ix")])
    assert r.returncode == 1
    assert f"cannot read __1_0.distcp" in r.stderr and "passes the end of the file" in r.stderr, r.stderr
    with mounter(ck, index=tmp_path / "ix") as m:
        bad, good = broken_and_intact(m.path)
        assert bad and good
        assert all(not b.endswith("README.txt") for b in bad)
        assert "__1_0.distcp" in m.log_text()
        assert "checkpoint.json" in good


def test_missing_data_file(ck, mounter, tmp_path):
    os.unlink(ck / "__0_0.distcp")
    r = run([ckptfs_bin(), "info", str(ck), "--index", str(tmp_path / "ix")])
    assert r.returncode == 1
    assert f"cannot open {ck}/__0_0.distcp: No such file or directory" in r.stderr, r.stderr
    with mounter(ck, index=tmp_path / "ix") as m:
        assert errno_of(m.path / INTACT) == errno.EIO
        assert "__0_0.distcp" in (m.path / "checkpoint.json").read_text()  # listed under "broken"
        assert "No such file" in m.log_text()


def test_corrupt_and_empty_metadata(ck, mounter, tmp_path):
    meta = ck / ".metadata"
    good = meta.read_bytes()
    meta.write_bytes(good[:100])
    r = run([ckptfs_bin(), "info", str(ck), "--index", str(tmp_path / "ix")])
    assert r.returncode == 1 and f"cannot parse {ck}/.metadata: " in r.stderr, r.stderr
    meta.write_bytes(b"")
    r = run([ckptfs_bin(), "info", str(ck), "--index", str(tmp_path / "ix")])
    assert r.returncode == 1 and f"cannot parse {ck}/.metadata: empty file" in r.stderr, r.stderr
    mnt = tmp_path / "m"
    mnt.mkdir()
    r = run([ckptfs_bin(), "mount", "-f", str(ck), str(mnt), "--index", str(tmp_path / "ix")], timeout=60)
    assert r.returncode == 1 and "empty file" in r.stderr
    assert not os.path.ismount(mnt)


def test_empty_distcp(ck, tmp_path):
    (ck / "__1_0.distcp").write_bytes(b"")
    r = run([ckptfs_bin(), "info", str(ck), "--index", str(tmp_path / "ix")])
    assert r.returncode == 1 and "cannot read __1_0.distcp" in r.stderr, r.stderr


def test_unknown_pickle_global_in_an_item(ck, mounter, tmp_path):
    f = ck / "__1_0.distcp"
    data = f.read_bytes()
    needle = b"torch._utils\n_rebuild_tensor_v2"
    assert needle in data
    f.write_bytes(data.replace(needle, b"posix._utils\n_rebuild_tensor_v2", 1))
    r = run([ckptfs_bin(), "info", str(ck), "--index", str(tmp_path / "ix")])
    assert r.returncode == 1
    assert "unknown pickle global posix._utils._rebuild_tensor_v2" in r.stderr, r.stderr
    assert "__1_0.distcp" in r.stderr
    with mounter(ck, index=tmp_path / "ix") as m:
        bad, good = broken_and_intact(m.path)
        assert len(bad) >= 1 and len(good) > len(bad)


def test_source_changed_under_a_running_mount(ck, mounter, tmp_path):
    with mounter(ck, index=tmp_path / "ix") as m:
        before = np.load(m.path / INTACT)
        time.sleep(0.02)
        with open(ck / "__1_0.distcp", "ab") as f:  # rewritten in place
            f.write(b"\0" * 10)
        e = errno_of(m.path / "params/out.weight/param.raw")  # never read before: no page cache
        assert e in (errno.ESTALE, errno.EIO), e
        assert "__1_0.distcp changed" in m.log_text() and "after indexing" in m.log_text()
    with mounter(ck, name="again", index=tmp_path / "ix") as m2:  # rebuilds, then serves
        np.testing.assert_array_equal(np.load(m2.path / INTACT), before)
        assert "rebuilding index" in m2.log_text() or "built" in m2.log_text()


@pytest.mark.parametrize("mapped,widened", [("on", False), ("off", False), ("on", True)])
def test_source_truncated_under_a_running_mount(dcp_fixtures, tmp_path, mounter, mapped, widened):
    """A shard cut short while mounted, after the mount has read from it (with
    mapped replies its window is mapped: a page past the new end must never
    reach the daemon as SIGBUS, and widened bf16 .npy files are converted from
    that mapping by the daemon itself): the other files of that shard are
    ESTALE / EIO with a log line naming it, and the daemon keeps answering."""
    ck = tmp_path / "ck"
    scenario = "fsdp2_bf16_w2" if widened else "dtensor_dim0_w2"
    shutil.copytree(dcp_fixtures / scenario, ck, ignore=shutil.ignore_patterns(".ckptfs"))
    shard = ck / "__1_0.distcp"
    with mounter(ck, index=tmp_path / "ix", extra=["--mapped-reads", mapped]) as m:
        files = sorted(p for p in (m.path / "params").rglob("*.npy" if widened else "*.raw")
                       if not widened or json.loads((p.parent / "info.json").read_text())["tensors"].get(
                           p.stem, {}).get("dtype") == "bfloat16")
        assert len(files) >= 4
        read_all(files[0])  # maps (or reads) the shard's first window
        os.truncate(shard, os.path.getsize(shard) // 3)
        for f in files[1:]:
            assert errno_of(f) in (errno.ESTALE, errno.EIO), f
        assert "__1_0.distcp changed size after indexing" in m.log_text()
        assert m.proc.poll() is None, m.log_text()[-2000:]
        assert json_ok(m.path / "checkpoint.json")
        if widened:  # the first file was converted from the mapping
            assert json.loads((m.path / ".ckptfs" / "stats").read_text())["mapped_conversions"] > 0


def json_ok(p):
    import json
    with open(p) as f:
        return bool(json.load(f))


@pytest.mark.parametrize("kind", ["symlink_out", "fifo"])
def test_item_leading_outside_or_special_is_refused(ck, mounter, tmp_path, kind):
    """A data file that is a symlink out of the checkpoint (to /etc/passwd) or a
    FIFO: never read or waited on; its tensors are EIO naming the file and why,
    everything else is served, and verify is not clean."""
    f = ck / "__1_0.distcp"
    f.unlink()
    if kind == "symlink_out":
        f.symlink_to("/etc/passwd")
        why = "outside the checkpoint directory"
    else:
        os.mkfifo(f)
        why = "a FIFO, not a regular file"
    r = run([ckptfs_bin(), "info", str(ck), "--index", str(tmp_path / "ix")], timeout=60)
    assert r.returncode == 1 and "__1_0.distcp" in r.stderr and why in r.stderr, r.stderr[-800:]
    with mounter(ck, index=tmp_path / "ix") as m:
        # Every DTensor here spans both rank files, and rank 1 wrote the bytes
        # items: all are EIO at open (they were once served as 0-byte files).
        bad, good = broken_and_intact(m.path)
        assert any(b.startswith("other/") for b in bad) and "checkpoint.json" in good, (bad[:3], good[:3])
        assert why in m.log_text() or why in (m.path / "checkpoint.json").read_text()
    v = run([ckptfs_bin(), "verify", str(ck), "--index", str(tmp_path / "ix")], timeout=60)
    assert v.returncode != 0 and "__1_0.distcp" in v.stdout + v.stderr


HOSTILE_NAMES = r'''
import sys, torch, torch.distributed.checkpoint as dcp
sd = {"w\udcff.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),  # surrogateescape'd byte
      "layers.0." + "x" * 50000: torch.ones(4),                               # 50,000-byte name
      "layers.1.ok.weight": torch.full((2, 2), 7.0)}
dcp.save(sd, checkpoint_id=sys.argv[1])
'''


def test_hostile_names_are_served_escaped(mounter, tmp_path):
    """Names torch can write but JSON, safetensors and NAME_MAX cannot hold: a
    lone surrogate (not UTF-8) and a 50,000-byte name. Nothing crashes (the
    layer-name regex overflowed the stack, nlohmann aborted on the bytes);
    every view serves them escaped and valid: checkpoint.json and report.json
    parse, safetensors opens hf/ and topo/ files, numpy reads the tensors."""
    import json
    import subprocess
    import sys
    from safetensors.numpy import load_file
    ck = tmp_path / "ck"
    subprocess.run([sys.executable, "-c", HOSTILE_NAMES, str(ck)], check=True, timeout=300, capture_output=True)
    ix = tmp_path / "ix"
    v = run([ckptfs_bin(), "verify", str(ck), "--index", str(ix), "--json"], timeout=120)
    assert v.returncode == 0, v.stderr[-2000:]
    json.loads(v.stdout)
    r = run([ckptfs_bin(), "info", str(ck), "--index", str(ix)], timeout=120)
    assert r.returncode == 0 and "w%ED%B3%BF.weight" in r.stdout and "(50009 bytes)" in r.stdout, r.stdout[-2000:]
    with mounter(ck, index=ix) as m:
        cj = json.loads((m.path / "checkpoint.json").read_text())
        assert cj["counts"]["params"] == 3, cj["counts"]
        json.loads((m.path / ".ckptfs/report.json").read_text())
        np.testing.assert_array_equal(np.load(m.path / "params/w%ED%B3%BF.weight/param.npy"),
                                      np.arange(6, dtype=np.float32).reshape(2, 3))
        long_dirs = [d for d in os.listdir(m.path / "params") if d.startswith("layers.0.")]
        assert len(long_dirs) == 1 and len(long_dirs[0].encode()) <= 255, long_dirs
        np.testing.assert_array_equal(np.load(m.path / "params" / long_dirs[0] / "param.npy"), np.ones(4, np.float32))
        json.loads((m.path / ("params/" + long_dirs[0] + "/info.json")).read_text())
        hf = {}
        for f in sorted(os.listdir(m.path / "hf")):
            if f.endswith(".safetensors"):
                hf.update(load_file(m.path / "hf" / f))
        assert "w%ED%B3%BF.weight" in hf and "layers.0." + "x" * 50000 in hf, sorted(k[:40] for k in hf)
        np.testing.assert_array_equal(hf["layers.1.ok.weight"], np.full((2, 2), 7.0, np.float32))
        topo = load_file(m.path / "topo/tp2-pp2/tp0-pp0.safetensors")
        assert "layers.0." + "x" * 50000 in topo, sorted(k[:40] for k in topo)


ZSTD_CK = r'''
import sys, torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.filesystem import FileSystemWriter, FileSystemReader
torch.manual_seed(0)
state = {"big": torch.randn(1 << 18), "small": torch.arange(8.0), "blob": {"k": torch.randn(1 << 16).numpy().tobytes()}}
dcp.save(state, storage_writer=FileSystemWriter(sys.argv[1], _extensions=[ZStandard()]))
md = FileSystemReader(sys.argv[1]).read_metadata()
for idx, info in md.storage_data.items():
    print(idx.fqn, info.relative_path, info.offset, info.length)
'''


def _zstd_bomb(n_bytes, length, declare):
    """A zstd frame of n_bytes zeros, padded with a skippable frame to exactly
    `length` bytes (so the item keeps its place in the file)."""
    import io
    import struct
    import zstandard
    buf = io.BytesIO()
    w = zstandard.ZstdCompressor(level=3).stream_writer(buf, size=n_bytes if declare else -1, closefd=False)
    zero = b"\0" * (1 << 20)
    for _ in range(n_bytes >> 20):
        w.write(zero)
    w.close()
    frame = buf.getvalue()
    assert len(frame) + 8 <= length, (len(frame), length)
    pad = length - len(frame) - 8
    return frame + struct.pack("<II", 0x184D2A50, pad) + b"\0" * pad


def _limited(args, mib):
    """Runs args and asserts its peak RSS stayed under `mib` MiB (RLIMIT_AS
    cannot be used: thread stacks and malloc arenas reserve far more address
    space than they touch)."""
    r = subprocess.run([sys.executable, "-c", "import resource, subprocess, sys;"
                        "r = subprocess.run(sys.argv[1:]);"
                        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr);"
                        "sys.exit(r.returncode)", *args], capture_output=True, text=True, timeout=300)
    peak_kib = int(r.stderr.strip().splitlines()[-1])
    assert peak_kib < mib << 10, f"peak RSS {peak_kib} KiB: {r.stderr[-2000:]}"
    return r


@pytest.mark.parametrize("declare", [True, False], ids=["declared_size", "streamed"])
def test_zstd_bombs_are_refused_within_bounded_memory(tmp_path, declare):
    """A 1 GiB (tensor) / 2 GiB (bytes) decompression bomb in place of a DCP
    zstd item: refused by size before allocating (declared) or as soon as the
    output passes what the metadata allows (streamed), with a peak RSS under
    256 MiB; every other entry still reads."""
    ck = tmp_path / "ck"
    r = subprocess.run([sys.executable, "-c", ZSTD_CK, str(ck)], check=True, timeout=300, capture_output=True, text=True)
    items = {l.split()[0]: l.split()[1:] for l in r.stdout.splitlines()}
    rel, off, length = items["big"][0], int(items["big"][1]), int(items["big"][2])
    with open(ck / rel, "r+b") as f:
        f.seek(off)
        f.write(_zstd_bomb(1 << 30, length, declare))
    ix = tmp_path / "ix"
    r = _limited([ckptfs_bin(), "info", str(ck), "--index", str(ix)], 256)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    want = "first frame declares 1073741824 bytes" if declare else "output larger than"
    assert f"cannot decompress {rel} @ {off}" in r.stderr and want in r.stderr, r.stderr[-2000:]
    c = subprocess.run([ckptfs_bin(), "cat", str(ck), "small", "--format", "raw", "--index", str(ix)],
                       capture_output=True, timeout=300)
    assert c.returncode == 0 and np.array_equal(np.frombuffer(c.stdout, np.float32), np.arange(8.0, dtype=np.float32))
    # A bytes item has no size in .metadata: --max-item-bytes bounds it.
    rel, off, length = items["blob.k"][0], int(items["blob.k"][1]), int(items["blob.k"][2])
    with open(ck / rel, "r+b") as f:
        f.seek(off)
        f.write(_zstd_bomb(1 << 31, length, declare))
    r = _limited([ckptfs_bin(), "info", str(ck), "--index", str(tmp_path / "ix2"), "--max-item-bytes", "64M"], 256)
    assert r.returncode == 1 and f"cannot decompress {rel} @ {off}" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("how", ["edit_restoring_mtime", "replaced_under_open_fd"])
def test_staleness_by_ctime_and_inode(ck, mounter, tmp_path, how):
    """An in-place edit that puts the mtime back (cp -p, rsync -t, touch -d)
    and a file replaced by rename while a reader holds the view file open are
    both ESTALE, never the old or the new bytes."""
    src = ck / "__1_0.distcp"
    with mounter(ck, index=tmp_path / "ix") as m:
        target = m.path / "params/out.weight/param.raw"
        held = open(target, "rb")  # opened before the change
        st = os.stat(src)
        data = bytearray(src.read_bytes())
        data[-200] ^= 0xFF
        time.sleep(0.02)
        if how == "edit_restoring_mtime":
            with open(src, "r+b") as f:
                f.write(bytes(data))
            os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
            assert os.stat(src).st_mtime_ns == st.st_mtime_ns and os.stat(src).st_size == st.st_size
        else:
            (ck / "new.tmp").write_bytes(bytes(data))
            os.utime(ck / "new.tmp", ns=(st.st_atime_ns, st.st_mtime_ns))
            os.rename(ck / "new.tmp", src)
        with pytest.raises(OSError) as e:
            held.read()
        held.close()
        assert e.value.errno in (errno.ESTALE, errno.EIO), e.value
        assert errno_of(target) in (errno.ESTALE, errno.EIO)
        assert "__1_0.distcp" in m.log_text() and ("modified" in m.log_text() or "replaced" in m.log_text())


def _flip_tensor_byte(ck, fqn):
    """Flips one byte inside the stored tensor record of `fqn`'s first chunk
    (a torch.save archive inside a .distcp), located with torch's own
    metadata reader and Python's zipfile: bit rot the ZIP CRC-32 records."""
    import io
    import struct
    import zipfile
    r = subprocess.run([sys.executable, "-c", "import sys\n"
                        "from torch.distributed.checkpoint.filesystem import FileSystemReader\n"
                        "md = FileSystemReader(sys.argv[1]).read_metadata()\n"
                        "for i, s in md.storage_data.items():\n"
                        "    print(i.fqn, s.relative_path, s.offset, s.length)\n", str(ck)],
                       check=True, capture_output=True, text=True, timeout=120)
    rel, off, length = next(l.split()[1:] for l in r.stdout.splitlines() if l.split()[0] == fqn)
    off, length = int(off), int(length)
    data = bytearray((ck / rel).read_bytes())
    z = zipfile.ZipFile(io.BytesIO(bytes(data[off:off + length])))
    info = next(i for i in z.infolist() if "/data/" in i.filename)
    h = info.header_offset
    name_len, extra_len = struct.unpack("<HH", data[off + h + 26:off + h + 30])
    start = off + h + 30 + name_len + extra_len
    data[start + info.file_size // 2] ^= 0x40
    (ck / rel).write_bytes(bytes(data))
    return rel


def test_flipped_tensor_byte_fails_its_crc(ck, mounter, tmp_path):
    """One flipped bit in a tensor's stored bytes: verify reports the CRC-32
    mismatch naming the file and entry (exit 1); a mount with
    --verify-on-read answers EIO for that tensor only; without it, the first
    read of .ckptfs/report.json finds it and the tensor is EIO from then on."""
    rel = _flip_tensor_byte(ck, "model.proj.weight")
    ix = tmp_path / "ix"
    v = run([ckptfs_bin(), "verify", str(ck), "--index", str(ix), "--json"], timeout=120)
    assert v.returncode == 1, (v.returncode, v.stdout[-2000:], v.stderr[-2000:])
    import json
    rep = json.loads(v.stdout)
    crc = [f for f in rep["findings"] if f["check"] == "checksum"]
    assert len(crc) == 1 and crc[0]["file"] == rel and "fails its CRC-32" in crc[0]["message"], rep["findings"]
    with mounter(ck, index=ix, extra=["--verify-on-read"]) as m:
        assert errno_of(m.path / "params/proj.weight/param.npy") == errno.EIO
        assert errno_of(m.path / "params/out.weight/param.npy") == 0
        assert "fails its CRC-32" in m.log_text()
    with mounter(ck, name="plain", index=ix) as m:
        json.loads((m.path / ".ckptfs/report.json").read_text())
        assert errno_of(m.path / "params/proj.weight/param.raw") == errno.EIO
        assert errno_of(m.path / "params/out.weight/param.raw") == 0


def edit_metadata(ck, statement):
    """Rewrites ck/.metadata with torch's own classes and pickle: `statement`
    runs on the unpickled Metadata `md`."""
    subprocess.run([sys.executable, "-c", "import pickle, sys, torch\n"
                    "p = sys.argv[1] + '/.metadata'\n"
                    "md = pickle.load(open(p, 'rb'))\n"
                    f"{statement}\n"
                    "pickle.dump(md, open(p, 'wb'))\n", str(ck)], check=True, timeout=120, capture_output=True)


def info_refuses_proj_weight(ck, ix, why):
    r = run([ckptfs_bin(), "info", str(ck), "--index", str(ix)], timeout=120)
    assert r.returncode == 1 and why in r.stderr and "model.proj.weight" in r.stderr, r.stderr


def test_chunk_with_the_wrong_number_of_dimensions_is_refused_per_tensor(ck, mounter, tmp_path):
    """A chunk whose offsets have fewer dimensions than its tensor: that tensor
    is refused naming both counts, the rest is served."""
    edit_metadata(ck, "md.state_dict_metadata['model.proj.weight'].chunks[0].offsets = torch.Size([0])")
    ix = tmp_path / "ix"
    info_refuses_proj_weight(ck, ix, "a chunk has 1 offsets and 2 sizes for a tensor of 2 dimensions")
    with mounter(ck, index=ix) as m:
        assert errno_of(m.path / "params/proj.weight/param.raw") == errno.EIO
        np.load(m.path / "params/out.weight/param.npy")


def test_overflowing_shape_is_eio_not_an_empty_file(ck, mounter, tmp_path):
    """A .metadata whose tensor size overflows 64 bits once multiplied out:
    that tensor is refused with the shape named; its .raw/.npy are EIO at open
    (they were 0-byte and header-only files); everything else is served."""
    edit_metadata(ck, "md.state_dict_metadata['model.proj.weight'].size = torch.Size([1 << 62, 1 << 10])")
    ix = tmp_path / "ix"
    info_refuses_proj_weight(ck, ix, "is more than 2^60 bytes")
    with mounter(ck, index=ix) as m:
        for f in ("param.raw", "param.npy"):
            assert errno_of(m.path / "params/proj.weight" / f) == errno.EIO
        np.load(m.path / "params/out.weight/param.npy")

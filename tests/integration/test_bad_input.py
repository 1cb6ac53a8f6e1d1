"""Damaged checkpoints: the CLI exits non-zero with "cannot <verb> <file>:
<reason>"; a mount serves every intact file and answers EIO (with a log line)
only for what is damaged; a source changed under a running mount answers
ESTALE, and the next mount rebuilds the index."""
import errno
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
        bad, good = broken_and_intact(m.path)  # every DTensor here spans both rank files
        assert bad and any(g.startswith("other/") for g in good), (bad[:3], good[:3])
        assert why in m.log_text() or why in (m.path / "checkpoint.json").read_text()
    v = run([ckptfs_bin(), "verify", str(ck), "--index", str(tmp_path / "ix")], timeout=60)
    assert v.returncode != 0 and "__1_0.distcp" in v.stdout + v.stderr

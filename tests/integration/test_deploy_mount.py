"""ckptfs next to the FUSE filesystems people already run: mount(8) and fstab
through mount.fuse.ckptfs, -o options, the source in findmnt, another user
through allow_other, a summary of what cannot be read (and --strict), one log
per mountpoint, umount --lazy, and the CLI conventions (per-command help,
one-line errors, validated values, one set of exit codes)."""
import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import ROOT, ckptfs_bin, fuse_usable, run

SAMPLE = ROOT / "samples" / "dcp-tiny"


def is_mounted(path):
    return any(line.split()[1] == str(path) for line in Path("/proc/mounts").read_text().splitlines())


def wait_mounted(path, timeout=60):
    deadline = time.time() + timeout
    while not is_mounted(path):
        assert time.time() < deadline, f"{path} did not mount"
        time.sleep(0.05)


@pytest.fixture
def world_dir():
    """A directory every user can traverse (pytest's tmp_path is 0700 root), so
    another uid can reach the mountpoint; everything under it unmounted at the end."""
    d = Path(tempfile.mkdtemp(prefix="ckptfs-deploy-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    for line in reversed(Path("/proc/mounts").read_text().splitlines()):
        mnt = line.split()[1]
        if mnt.startswith(str(d) + "/"):
            subprocess.run(["fusermount3", "-uz", mnt], capture_output=True, timeout=60)
    shutil.rmtree(d, ignore_errors=True)


def sample_copy(dst):
    shutil.copytree(SAMPLE, dst)
    return dst


@contextlib.contextmanager
def mount_helper_installed():
    """mount(8) runs /sbin/mount.<type> for `-t fuse.ckptfs`: the binary itself,
    called by that name (what `cmake --install` and the .deb put there)."""
    if os.geteuid() != 0:
        pytest.skip("mount(8) with a helper in /sbin needs root")
    if not fuse_usable() or shutil.which("mount") is None:
        pytest.skip("no usable /dev/fuse or mount(8)")
    helper = Path("/sbin/mount.fuse.ckptfs")
    if helper.exists() or helper.is_symlink():
        pytest.skip(f"{helper} is already installed (not replacing it)")
    helper.symlink_to(os.path.abspath(ckptfs_bin()))
    try:
        yield
    finally:
        helper.unlink()


def other_user():
    try:
        return pwd.getpwnam("nobody").pw_name
    except KeyError:
        pytest.skip("no 'nobody' user")


def as_user(user, *cmd):
    return subprocess.run(["runuser", "-u", user, "--", *cmd], capture_output=True, text=True, timeout=60)


def test_cli_conventions(bin_path, tmp_path):
    v = run([bin_path, "--version"])
    assert v.returncode == 0 and v.stdout.startswith("ckptfs ") and "index schema" in v.stdout
    # Per-command help, the same from `help CMD` and `CMD --help`.
    h1, h2 = run([bin_path, "help", "mount"]), run([bin_path, "mount", "--help"])
    assert h1.returncode == h2.returncode == 0 and h1.stdout == h2.stdout
    assert "Usage: ckptfs mount" in h1.stdout and "allow_other" in h1.stdout and "--deep" not in h1.stdout
    top = run([bin_path, "--help"])
    assert top.returncode == 0 and "exit codes" in top.stdout and "umount" in top.stdout
    # Usage errors: exit 2, one line naming the command, a pointer to its help.
    for args, what in [(["mount", "a", "b", "--bogus"], "--bogus"),
                       (["mount", "a", "b", "--threads", "abc"], "--threads"),
                       (["verify", "a", "--num-layers", "-3"], "--num-layers"),
                       (["mount", "a", "b", "-o", "rw"], "read-only"),
                       (["mount", "a", "b", "-o", "allow_other,colour=blue"], "colour=blue"),
                       (["cat", "a", "k", "--format", "csv"], "--format"),
                       (["frobnicate"], "unknown command")]:
        r = run([bin_path, *args])
        assert r.returncode == 2 and what in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
        assert "--help" in r.stderr, (args, r.stderr)
    assert run([bin_path]).returncode == 2
    # Not a checkpoint: the same exit code (1) from every command that reads SRC.
    (tmp_path / "x.txt").write_text("hello")
    for cmd in (["info"], ["index"], ["verify"], ["ls"], ["cat", "--", "k"]):
        args = [bin_path, cmd[0], str(tmp_path), *cmd[1:]]
        r = run(args)
        assert r.returncode == 1 and "cannot detect a checkpoint" in r.stderr, (cmd, r.returncode, r.stderr)


def test_mount8_fstab_allow_other_and_findmnt(world_dir):
    """`mount -t fuse.ckptfs SRC MNT -o ...` and fstab lines (through mount -T):
    the source shows in findmnt, another user reads with allow_other and is
    refused without it, uid= sets the owner, umount(8) unmounts."""
    user = other_user()
    src = sample_copy(world_dir / "ck, with a comma")
    ix = world_dir / "ix"
    with mount_helper_installed():
        mnt = world_dir / "mnt"
        mnt.mkdir()
        r = run(["mount", "-t", "fuse.ckptfs", str(src), str(mnt), "-o",
                 f"ro,allow_other,uid=65534,index={ix},log={world_dir / 'a.log'}"])
        assert r.returncode == 0, r.stderr
        try:
            wait_mounted(mnt)
            f = run(["findmnt", "-n", "-o", "SOURCE,FSTYPE", "--mountpoint", str(mnt)])
            assert f.stdout.split() == [*str(src).split(), "fuse.ckptfs"], f.stdout
            assert "allow_other" in run(["findmnt", "-n", "-o", "OPTIONS", str(mnt)]).stdout
            assert (mnt / "params").stat().st_uid == 65534
            c = as_user(user, "cat", str(mnt / "checkpoint.json"))
            assert c.returncode == 0 and '"family"' in c.stdout, c.stderr
            assert str(mnt) in (world_dir / "a.log").read_text()  # every line names its mount
        finally:
            u = run(["umount", str(mnt)])
        assert u.returncode == 0 and not is_mounted(mnt), u.stderr

        # Without allow_other another user is refused (the Slurm-prolog trap).
        r = run(["mount", "-t", "fuse.ckptfs", str(src), str(mnt), "-o", f"index={ix},log={world_dir / 'b.log'}"])
        assert r.returncode == 0, r.stderr
        wait_mounted(mnt)
        c = as_user(user, "ls", str(mnt))
        assert c.returncode != 0 and "Permission denied" in c.stderr, (c.returncode, c.stderr)
        assert run([ckptfs_bin(), "umount", str(mnt)]).returncode == 0 and not is_mounted(mnt)

        # fstab: `mount -a` mounts the auto line; a noauto / x-systemd.automount
        # line mounts when named (what systemd's automount unit runs).
        auto_mnt, lazy_mnt = world_dir / "auto", world_dir / "ondemand"
        auto_mnt.mkdir()
        lazy_mnt.mkdir()
        fstab = world_dir / "fstab"
        esc = str(src).replace(" ", "\\040")
        fstab.write_text(
            f"{esc} {auto_mnt} fuse.ckptfs ro,nofail,_netdev,allow_other,index={ix},log={world_dir / 'c.log'} 0 0\n"
            f"{esc} {lazy_mnt} fuse.ckptfs ro,noauto,x-systemd.automount,allow_other,index={ix},"
            f"log={world_dir / 'd.log'} 0 0\n")
        r = run(["mount", "-T", str(fstab), "-a"])
        assert r.returncode == 0, r.stderr
        wait_mounted(auto_mnt)
        assert not is_mounted(lazy_mnt)
        r = run(["mount", "-T", str(fstab), str(lazy_mnt)])
        assert r.returncode == 0, r.stderr
        wait_mounted(lazy_mnt)
        a = as_user(user, "cmp", str(auto_mnt / "checkpoint.json"), str(lazy_mnt / "checkpoint.json"))
        assert a.returncode == 0, a.stderr
        for m in (auto_mnt, lazy_mnt):
            assert run(["umount", str(m)]).returncode == 0 and not is_mounted(m)


def test_unreadable_summary_strict_and_grouped_info(world_dir):
    """A truncated shard: mount says in one line how many tensors cannot be read,
    --strict refuses to mount, info prints each reason once with a count."""
    if not fuse_usable():
        pytest.skip("no usable /dev/fuse")
    src = sample_copy(world_dir / "ck")
    shard = src / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:64])
    mnt = world_dir / "mnt"
    mnt.mkdir()
    log = world_dir / "m.log"
    bad = run([ckptfs_bin(), "info", str(src)])
    assert bad.returncode == 1
    n_bad = sum(1 for line in bad.stdout.splitlines() if line.endswith("UNREADABLE"))
    assert n_bad >= 2, bad.stdout
    reasons = [line for line in bad.stderr.splitlines() if "cannot" in line]
    assert len(reasons) < n_bad and "for the same reason" in bad.stderr, bad.stderr
    assert f"{n_bad} tensor(s) cannot be read" in bad.stderr and "__1_0.distcp" in bad.stderr, bad.stderr

    r = run([ckptfs_bin(), "mount", str(src), str(mnt), "--strict", "--log", str(log)])
    assert r.returncode == 1 and "--strict" in r.stderr and not is_mounted(mnt), r.stderr
    r = run([ckptfs_bin(), "mount", str(src), str(mnt), "--log", str(log)])
    try:
        assert r.returncode == 0, r.stderr
        warn = [line for line in r.stderr.splitlines() if "cannot be read" in line]
        assert len(warn) == 1 and f"{n_bad} of " in warn[0] and "ckptfs info" in warn[0], r.stderr
        assert "cannot be read" in log.read_text()
    finally:
        run([ckptfs_bin(), "umount", str(mnt)])


def test_logs_are_per_mountpoint_and_debug_keeps_log(world_dir):
    """Two mountpoints with the same basename get two logs (the default name is
    the escaped full path) whose lines name their mount; --debug with --log
    writes there."""
    if not fuse_usable():
        pytest.skip("no usable /dev/fuse")
    src = sample_copy(world_dir / "ck")
    ix = world_dir / "ix"
    mnts = [world_dir / "a" / "mnt", world_dir / "b" / "mnt"]
    logs = []
    try:
        for m in mnts:
            m.mkdir(parents=True)
            r = run([ckptfs_bin(), "mount", str(src), str(m), "--index", str(ix)])
            assert r.returncode == 0, r.stderr
            logs.append(r.stdout.split("(log: ")[1].rstrip(")\n"))
        assert logs[0] != logs[1], logs
        for m, log in zip(mnts, logs):
            text = Path(log).read_text()
            assert f"ckptfs[{m}] info: mounted" in text, text
    finally:
        for m in mnts:
            run([ckptfs_bin(), "umount", str(m)])
    dbg_log = world_dir / "debug.log"
    m = mnts[0]
    p = subprocess.Popen([ckptfs_bin(), "mount", str(src), str(m), "--index", str(ix), "--debug",
                          "--log", str(dbg_log)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_mounted(m)
        assert "info: mounted" in dbg_log.read_text()
    finally:
        run([ckptfs_bin(), "umount", str(m)])
        p.wait(timeout=30)


def test_umount_busy_then_lazy(world_dir):
    if not fuse_usable():
        pytest.skip("no usable /dev/fuse")
    src = sample_copy(world_dir / "ck")
    m = world_dir / "mnt"
    m.mkdir()
    assert run([ckptfs_bin(), "mount", str(src), str(m)]).returncode == 0
    f = open(m / "checkpoint.json", "rb")
    try:
        r = run([ckptfs_bin(), "umount", str(m)])
        assert r.returncode == 1 and "umount --lazy" in r.stderr and is_mounted(m), r.stderr
        r = run([ckptfs_bin(), "umount", "--lazy", str(m)])
        assert r.returncode == 0 and not is_mounted(m), r.stderr
        assert b"family" in f.read()  # an open file keeps working after a lazy unmount
    finally:
        f.close()


def test_mount_fuse3_without_the_helper_runs_ckptfs_src_mnt(world_dir):
    """A fuse.ckptfs entry on a node with no mount.fuse.ckptfs installed (a binary
    copied there, a Python wheel): /sbin/mount.fuse3 runs `ckptfs SRC MNT -o OPTS`,
    the helper's form, which mounts; a mistyped command is still refused."""
    mount_fuse3 = shutil.which("mount.fuse3") or "/sbin/mount.fuse3"
    if os.geteuid() != 0 or not fuse_usable() or not os.path.exists(mount_fuse3):
        pytest.skip("needs root, /dev/fuse and mount.fuse3")
    if shutil.which("mount.fuse.ckptfs"):
        pytest.skip("mount.fuse.ckptfs is installed (mount.fuse3 is not what runs then)")
    bindir = world_dir / "bin"
    bindir.mkdir()
    (bindir / "ckptfs").symlink_to(os.path.abspath(ckptfs_bin()))  # only `ckptfs` on PATH
    src, mnt = sample_copy(world_dir / "ck"), world_dir / "mnt"
    mnt.mkdir()
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}")
    r = subprocess.run([mount_fuse3, str(src), str(mnt), "-t", "ckptfs", "-o",
                        f"ro,nodev,nosuid,index={world_dir / 'idx'}"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        wait_mounted(mnt)
        assert (mnt / "checkpoint.json").read_bytes()
        assert "params" in os.listdir(mnt)
    finally:
        run([ckptfs_bin(), "umount", str(mnt)])
    bad = run([ckptfs_bin(), "mnt", str(src)])
    assert bad.returncode == 2 and "unknown command" in bad.stderr, bad.stderr

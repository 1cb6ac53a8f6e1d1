"""Real-mount test harness: the ckptfs binary, real checkpoints written by torch,
and a `mount` helper that mounts in a private directory with a timeout and
always unmounts. Tests skip (by feature) when /dev/fuse is unusable."""
import atexit
import contextlib
import fcntl
import gc
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
MOUNT_TIMEOUT = 60


def ckptfs_bin():
    b = os.environ.get("CKPTFS_BIN") or str(ROOT / "build" / "ckptfs")
    if not os.access(b, os.X_OK):
        pytest.skip(f"ckptfs binary not built at {b}")
    return b


@pytest.fixture(scope="session")
def bin_path():
    return ckptfs_bin()


def fuse_usable():
    return os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None


# scripts/test.sh runs this suite on every core with pytest-xdist
# (`-n auto --dist loadgroup`): each module is one group, so it runs on one
# worker and its module fixtures are made once; the modules that put files in
# /usr/sbin (a mount(8) helper, the installed package) share a group.
SHARED_GROUP = {"test_deploy_mount.py": "system-paths", "test_package.py": "system-paths"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(SHARED_GROUP.get(item.path.name, item.path.name)))


@contextlib.contextmanager
def fixture_lock(path, wait=True):
    """Held while the cached fixture at `path` is checked and written: two
    workers wanting the same one take turns, the second finds it made.
    wait=False: yields False at once when another worker holds it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_fixture_script(cmd, timeout):
    """Runs a fixture generator; when it fails, the assertion shows the end of
    what it printed (its traceback), not only its exit status."""
    r = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-6000:]}"


@pytest.fixture(scope="session")
def dcp_fixtures(tmp_path_factory):
    """All DCP scenarios of make_dcp.py, written once per session by torch
    (or reused from $CKPTFS_FIXTURE_CACHE, a directory kept between runs)."""
    out = os.environ.get("CKPTFS_FIXTURE_CACHE") or str(tmp_path_factory.mktemp("dcp"))
    with fixture_lock(Path(out) / "make_dcp"):
        run_fixture_script([sys.executable, str(FIXTURES / "make_dcp.py"), out], timeout=900)
    return Path(out)


@pytest.fixture(scope="session")
def accelerate_fixtures(tmp_path_factory):
    """make_accelerate.py's Accelerate FSDP2 checkpoint (cached like dcp_fixtures)."""
    out = os.environ.get("CKPTFS_FIXTURE_CACHE") or str(tmp_path_factory.mktemp("accelerate"))
    with fixture_lock(Path(out) / "make_accelerate"):
        run_fixture_script([sys.executable, str(FIXTURES / "make_accelerate.py"), out], timeout=900)
    return Path(out) / "fsdp2_sharded_w2"


def run_producer(cmd, out, env, timeout=900):
    """Runs a multi-process fixture producer into `out` (emptied first), once
    more if it fails: gloo's rendezvous port can be taken between pick and bind."""
    for attempt in range(2):
        shutil.rmtree(out, ignore_errors=True)
        r = subprocess.run(cmd, timeout=timeout, env=env, capture_output=True, text=True)
        if r.returncode == 0:
            return
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]


def make_megatron_fixtures(root, scenarios):
    """Writes each make_megatron.py scenario (name -> arguments) under `root`
    unless a complete one is there (cached between runs). Workers share the
    work: one that finds a scenario being written by another goes on to the
    next, and waits only when every one left is being written."""
    pending = list(scenarios)
    while pending:
        for name in list(pending):
            out = Path(root) / name
            with fixture_lock(out, wait=False) as mine:
                if not mine:
                    continue
                if not ((out / "reference").is_dir() and (out / "latest_checkpointed_iteration.txt").exists()):
                    shutil.rmtree(out, ignore_errors=True)
                    args = scenarios[name]
                    run_fixture_script([sys.executable, str(FIXTURES / "make_megatron.py"), args[0], str(out)] + args[1:],
                                       timeout=600)
                pending.remove(name)
        if pending:  # all being written elsewhere: wait for the first, then look again
            with fixture_lock(Path(root) / pending[0]):
                pass
    return Path(root)


def megatron_saved_param_groups(src):
    """A Megatron checkpoint's param groups as saved, as a list per file
    (every rank steps with the same hyperparameters): common.pt's (torch_dist,
    zarr); where the distributed optimizer keeps them in per-DP-rank objects
    (dp_reshardable), those objects' groups read through torch's DCP reader,
    one per (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr); else each
    stage's TP rank 0 model_optim_rng.pt's (legacy: the non-distributed
    optimizer lists its members' ids per stage). A ChainedOptimizer's (MoE)
    groups follow one another, the dense optimizer's first."""
    import torch

    def groups_of(o):  # a ChainedOptimizer's (MoE) members' groups one after another
        if isinstance(o, list):
            return [g for sub in o for g in groups_of(sub)]
        # common.pt keys them 0, 1, ...; chained_0, chained_1, ... elsewhere
        chained = sorted((k for k in o if isinstance(k, int) or str(k).startswith("chained_")),
                         key=lambda k: k if isinstance(k, int) else int(k[len("chained_"):]))
        if chained:
            return [g for k in chained for g in groups_of(o[k])]
        return o.get("optimizer", o)["param_groups"]

    if (src / "latest_checkpointed_iteration.txt").exists():
        it = int((src / "latest_checkpointed_iteration.txt").read_text().strip())
        d = src / f"iter_{it:07d}"
    else:  # NeMo 2's checkpoints/ directory: its one checkpoint's weights/
        found = sorted(src.glob("*/weights/common.pt"))
        assert len(found) == 1, (src, found)
        d = found[0].parent
    if not (d / "common.pt").exists():
        files = sorted(d.glob("mp_rank_00*/model_optim_rng.pt"))
        assert files, d
        return [groups_of(torch.load(f, weights_only=False)["optimizer"]) for f in files]
    o = torch.load(d / "common.pt", weights_only=False)["optimizer"]
    if isinstance(o, list) and len(o) == 1:  # Lightning's list of its one optimizer (NeMo 2)
        o = o[0]

    def per_dp_rank(m):  # a layout that keeps the groups in per-DP-rank objects: {param_state_sharding_type}
        return isinstance(m, dict) and set(m) == {"param_state_sharding_type"}

    members = sorted(k for k in o if isinstance(k, int))
    if per_dp_rank(o):
        return [objects_groups(d, "")]
    if members and all(per_dp_rank(o[k]) for k in members):  # a MoE ChainedOptimizer's, per member
        return [[g for k in members for g in objects_groups(d, f"chained_{k}.")]]
    return [groups_of(o)]


def objects_groups(d, prefix):
    """The param groups of the distributed optimizer's per-DP-rank objects
    `<prefix>optimizer.distributed.dp_group_idx_M.optimizer/shard_*` in the
    torch_dist directory `d`, read through torch's DCP reader, one per (wd_mult,
    lr_mult, is_expert_parallel, is_decoupled_lr), first seen first."""
    import re
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    keys = [k for k in FileSystemReader(d).read_metadata().state_dict_metadata
            if re.fullmatch(re.escape(prefix) + r"optimizer\.distributed\.dp_group_idx_\d+\.optimizer/shard_.*", k)]
    assert keys, (d, prefix)
    objects = {k: None for k in keys}
    dcp.load(objects, storage_reader=FileSystemReader(d), no_dist=True)
    groups, seen = [], set()
    for k in sorted(keys):
        obj = objects[k]
        for inst in (x for y in obj for x in (y if isinstance(y, list) else [y])) if isinstance(obj, list) else [obj]:
            for g in inst["param_groups"]:
                ident = tuple(g.get(n) for n in ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr"))
                if ident not in seen:
                    seen.add(ident)
                    groups.append(g)
    return groups


def run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, timeout=kw.pop("timeout", 300), **kw)


class Mounted:
    def __init__(self, path, log, proc):
        self.path = Path(path)
        self.log = Path(log)
        self.proc = proc

    def log_text(self):
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@contextlib.contextmanager
def mount(src, tmp_path, name="mnt", index=None, extra=()):
    if not fuse_usable():
        pytest.skip("no usable /dev/fuse or fusermount3")
    mnt = Path(tmp_path) / name
    mnt.mkdir(parents=True, exist_ok=True)
    log = Path(tmp_path) / f"{name}.log"
    args = [ckptfs_bin(), "mount", "-f", str(src), str(mnt)]
    if index:
        args += ["--index", str(index)]
    args += list(extra)
    with open(log, "w") as lf:
        proc = subprocess.Popen(args, stdout=lf, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + MOUNT_TIMEOUT
        while not os.path.ismount(mnt):
            if proc.poll() is not None:
                raise RuntimeError(f"ckptfs mount exited {proc.returncode}: {log.read_text()}")
            if time.time() > deadline:
                raise RuntimeError(f"mount did not come up in {MOUNT_TIMEOUT}s: {log.read_text()}")
            time.sleep(0.05)
        yield Mounted(mnt, log, proc)
    finally:
        unmount(mnt, proc)


# Daemons whose mount was detached while the test still mapped one of its
# files (a transformers model loaded from hf/ without a copy); they serve it
# until it is unmapped, and are stopped at the end of the session.
LINGERING = []


def unmount(mnt, proc):
    u = subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, text=True, timeout=60)
    if u.returncode != 0 and "busy" in u.stderr:
        gc.collect()  # mappings nothing refers to any more
        u = subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, text=True, timeout=60)
    if u.returncode != 0 and "busy" in u.stderr and proc.poll() is None:
        # Still mapped by a live object: detach now (the daemon keeps serving
        # the mapping, so it stays valid) instead of waiting for the daemon.
        subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True, timeout=60)
        if not LINGERING:
            atexit.register(stop_lingering)
        LINGERING.append(proc)
        return
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True, timeout=60)
        proc.wait(timeout=30)


def stop_lingering():
    for proc in LINGERING:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def mounter(tmp_path):
    def _m(src, name="mnt", **kw):
        return mount(src, tmp_path, name=name, **kw)
    return _m

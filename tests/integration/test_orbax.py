"""Orbax (JAX) checkpoints, read against orbax-checkpoint itself.

The committed checkpoints of tests/data/orbax/ (written by orbax-checkpoint
0.12.8 / jax 0.10.2, see its README.md) are copied into the session's temporary
directory (ckptfs writes its index into <src>/.ckptfs/, so the committed files
are never mounted or indexed in place). For each one:

* orbax restores the latest step NOW, in this test (CheckpointManager, or the v1
  training.Checkpointer for the v1 layout, into host numpy arrays), and what it
  restores must equal the committed expected.npz (a guard on the fixture);
* the mount of the CheckpointManager root serves every array bit for bit as
  orbax restores it: `.raw` = the restored array's bytes, `.npy` = the restored
  array (bfloat16 widened to float32); `_METADATA`, `_sharding` and
  `_CHECKPOINT_METADATA` verbatim under other/; the step is the latest finished
  one, and the other / unfinished steps are named; a step directory and an item
  directory mounted directly serve their own step;
* `ckptfs cat` and the Python package give the same bytes;
* torch's own DCP reader (FileSystemReader) loads the mount's dcp/ into torch
  tensors shaped from orbax's restore, equal to it (bfloat16 included);
* `verify` (and `--deep`, whose norms numpy recomputes) is clean; a truncated
  OCDBT data file, a truncated B+tree node and a deleted zarr chunk are named by
  verify / info and answer EIO only where tensorstore itself cannot read;
* a directory holding only an unfinished save is refused, and nothing is written
  into it;
* tensorstore's own OCDBT listing equals the committed ts_listing.json (which the
  C++ unit tests use).
"""
import errno
import json
import os
import shutil
import subprocess
import time

import numpy as np
import pytest

from conftest import ROOT, ckptfs_bin, run

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

DATA = ROOT / "tests" / "data" / "orbax"
FIXTURES = ["v0_f32", "v0_bf16", "v0_zarr3", "no_ocdbt_zarr2", "no_ocdbt_zarr3", "v1", "multiprocess", "tmp_step",
            "v0_scan_bf16"]
OCDBT = [n for n in FIXTURES if not n.startswith("no_ocdbt")]
ORBAX_FILES = ("_METADATA", "_sharding")  # in the item directory; _CHECKPOINT_METADATA in the step directory


def item_name(name):
    return "state" if name == "v1" else "default"


def tree_path(name):
    """The mount path (without .npy / .raw) of orbax's param name."""
    if name.startswith("params."):
        return f"params/{name[len('params.'):]}/param"
    for prefix, state in (("opt_state.0.mu.", "exp_avg"), ("opt_state.0.nu.", "exp_avg_sq")):
        if name.startswith(prefix):
            return f"params/{name[len(prefix):]}/{state}"
    return f"other/{name}"


def fqn_state(name):
    """(params/ name, state) of orbax's param name; (name, "") for other/."""
    p = tree_path(name)
    if p.startswith("other/"):
        return p[len("other/"):], ""
    fqn, state = p[len("params/"):].rsplit("/", 1)
    return fqn, state


def is_bf16(a):
    return a.dtype.name == "bfloat16"


def widened(a):
    """What a .npy file holds for orbax's array: bfloat16 widened to float32 (exact), else the array."""
    return a.astype(np.float32) if is_bf16(a) else a


def flat_names(tree):
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    out = {}
    for path, v in flat:
        parts = []
        for k in path:
            for attr in ("key", "idx", "name"):
                if hasattr(k, attr):
                    parts.append(str(getattr(k, attr)))
                    break
            else:
                raise TypeError(f"unexpected key {k!r}")
        out[".".join(parts)] = np.asarray(v)
    return out


def orbax_restore(root, name, step=None):
    """(step, {param name: host numpy array}): what orbax restores from the
    CheckpointManager root `root` (the latest step when `step` is None)."""
    jax = pytest.importorskip("jax")
    ocp = pytest.importorskip("orbax.checkpoint")
    if name == "v1":
        import orbax.checkpoint.experimental.v1 as ocp1

        with ocp1.training.Checkpointer(str(root)) as ckptr:
            step = ckptr.latest.step if step is None else step
            meta = ckptr.metadata(step).metadata
            abstract = jax.tree.map(lambda m: np.empty(m.shape, m.dtype), meta)  # numpy leaves: restore to host
            tree = ckptr.load(step, abstract)
    else:
        mngr = ocp.CheckpointManager(str(root), item_handlers=ocp.PyTreeCheckpointHandler(),
                                     options=ocp.CheckpointManagerOptions(read_only=True))
        try:
            step = mngr.latest_step() if step is None else step
            meta = mngr.item_metadata(step)
            restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta.tree)
            tree = mngr.restore(step, args=ocp.args.PyTreeRestore(restore_args=restore_args))
        finally:
            mngr.close()
    arrays = flat_names(tree)
    assert arrays and all(isinstance(v, np.ndarray) for v in arrays.values())
    return step, arrays


def check_expected(arrays, npz):
    """orbax's restore equals the committed expected*.npz (dtype, shape, bytes)."""
    with np.load(npz) as e:
        meta = json.loads(str(e["__dtype__"]))
        assert set(arrays) == set(meta), set(arrays) ^ set(meta)
        for k, a in arrays.items():
            assert str(a.dtype) == meta[k]["dtype"] and list(a.shape) == meta[k]["shape"], k
            want = e[k]
            got = a.view(np.uint16) if is_bf16(a) else a
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), k


@pytest.fixture(scope="session")
def copies(tmp_path_factory):
    """name -> a copy of tests/data/orbax/<name>/ (made once per session and worker)."""
    base = tmp_path_factory.mktemp("orbax")
    made = {}

    def get(name):
        if name not in made:
            shutil.copytree(DATA / name, base / name)
            made[name] = base / name
        return made[name]
    return get


@pytest.fixture(scope="session")
def restored(tmp_path_factory):
    """(name, step) -> (step, arrays) that orbax restores, from a copy of its own that
    ckptfs never touches; restored once per session and worker, checked against
    expected*.npz."""
    base = tmp_path_factory.mktemp("orbax-restore")
    cache = {}

    def get(name, step=None):
        if (name, step) not in cache:
            src = base / name
            if not src.exists():
                shutil.copytree(DATA / name, src)
            got_step, arrays = orbax_restore(src / "ckpt", name, step)
            steps = json.loads((DATA / name / "steps.json").read_text())
            npz = "expected.npz" if got_step == steps["latest_step"] else f"expected_{got_step}.npz"
            check_expected(arrays, DATA / name / npz)
            cache[(name, step)] = (got_step, arrays)
        return cache[(name, step)]
    return get


def read_bytes(p):
    with open(p, "rb") as f:
        return f.read()


def errno_of(p):
    try:
        read_bytes(p)
    except OSError as e:
        return e.errno
    return 0


def check_tree(mnt, arrays, item_dir, step_dir=None, skip=()):
    """Every array of orbax's restore is served bit for bit, and nothing else is
    under params/ and other/; orbax's metadata files are served verbatim."""
    want = {}
    for name in arrays:
        fqn, state = fqn_state(name)
        if state:
            want.setdefault(fqn, set()).update({f"{state}.npy", f"{state}.raw"})
    assert {p.name for p in (mnt / "params").iterdir()} == set(want)
    for fqn, files in want.items():
        assert {p.name for p in (mnt / "params" / fqn).iterdir()} == files | {"info.json"}, fqn
    other = {f"{n}.{x}" for n in arrays if tree_path(n).startswith("other/") for x in ("npy", "raw")}
    other |= set(ORBAX_FILES) | ({"_CHECKPOINT_METADATA"} if step_dir else set())
    assert {p.name for p in (mnt / "other").iterdir()} == other
    for f in ORBAX_FILES:
        assert read_bytes(mnt / "other" / f) == read_bytes(item_dir / f), f
    if step_dir:
        assert read_bytes(mnt / "other" / "_CHECKPOINT_METADATA") == read_bytes(step_dir / "_CHECKPOINT_METADATA")
    for name, a in arrays.items():
        if name in skip:
            continue
        p = mnt / tree_path(name)
        assert read_bytes(f"{p}.raw") == a.tobytes(), name
        npy = np.load(f"{p}.npy")
        w = widened(a)
        assert npy.dtype == w.dtype and npy.shape == w.shape and npy.tobytes() == w.tobytes(), name


def checkpoint_json(mnt):
    return json.loads((mnt / "checkpoint.json").read_text())


# ---------------------------------------------------------------- 1. mounts vs orbax's restore

@pytest.mark.parametrize("name", FIXTURES)
def test_mount_serves_what_orbax_restores(name, copies, restored, mounter):
    step, arrays = restored(name)
    steps = json.loads((DATA / name / "steps.json").read_text())
    assert step == steps["latest_step"]
    src = copies(name) / "ckpt"
    with mounter(src) as m:
        cj = checkpoint_json(m.path)
        assert cj["family"] == "orbax" and cj["step"] == step and cj["broken"] == [] and cj["findings"] == []
        n_params = sum(1 for k in arrays if k.startswith("params."))
        assert cj["counts"]["params"] == n_params and cj["counts"]["optimizer_states"] == 2 * n_params
        check_tree(m.path, arrays, src / str(step) / item_name(name), step_dir=src / str(step))


def test_other_steps_and_unfinished_save_are_named(copies, bin_path):
    """The root mounts the latest finished step (2, never the unfinished 3); the
    other finished steps and the unfinished save are named in checkpoint.json's
    problems, in `ckptfs info`'s notes and in verify's notes."""
    for name, step, named in (("v0_f32", 2, "1"), ("tmp_step", 2, "3.orbax-checkpoint-tmp")):
        src = copies(name) / "ckpt"
        r = run([bin_path, "info", str(src)])
        assert r.returncode == 0, r.stderr
        assert f"\nstep        {step}\n" in r.stdout, r.stdout[:600]
        notes = r.stdout.split("\nKEY ")[0]
        assert "\nnotes       " in notes and named in notes, notes
        r = run([bin_path, "cat", str(src), "checkpoint.json"])
        assert r.returncode == 0, r.stderr
        cj = json.loads(r.stdout)
        assert cj["step"] == step
        if name == "v0_f32":
            note = [p for p in cj["problems"] if "orbax steps" in p]
            assert len(note) == 1 and "steps 1 are in this directory" in note[0] and "latest, 2" in note[0], note
        else:
            note = [p for p in cj["problems"] if "unfinished" in p]
            assert len(note) == 1 and named in note[0], cj["problems"]
        r = run([bin_path, "verify", "--json", str(src)])
        assert r.returncode == 0, r.stderr
        rep = json.loads(r.stdout)
        assert rep["step"] == step and any(named in n for n in rep["notes"]), rep["notes"]


def test_step_dir_and_item_dir_mount_their_own_step(copies, restored, mounter, tmp_path):
    src = copies("v0_f32") / "ckpt"
    step1, arrays1 = restored("v0_f32", 1)
    step2, arrays2 = restored("v0_f32", 2)
    assert (step1, step2) == (1, 2)
    assert any(arrays1[k].tobytes() != arrays2[k].tobytes() for k in arrays1)  # two different states
    with mounter(src / "1", name="step1", index=tmp_path / "ix1") as m:
        assert checkpoint_json(m.path)["step"] == 1
        check_tree(m.path, arrays1, src / "1" / "default", step_dir=src / "1")
    with mounter(src / "2" / "default", name="item2", index=tmp_path / "ix2") as m:
        check_tree(m.path, arrays2, src / "2" / "default")


# ---------------------------------------------------------------- 2. ckptfs cat and the Python package

@pytest.mark.parametrize("name", ["v0_f32", "v0_bf16", "no_ocdbt_zarr3"])
def test_cli_cat_equals_mount(name, copies, restored, mounter):
    _, arrays = restored(name)
    src = copies(name) / "ckpt"
    picks = ["params.tok_embeddings", "opt_state.0.nu.layers.layers_1.feed_forward.w2", "params.norm",
             "opt_state.0.count"]
    with mounter(src) as m:
        for n in picks:
            for ext in ("raw", "npy"):
                rel = f"{tree_path(n)}.{ext}"
                r = subprocess.run([ckptfs_bin(), "cat", str(src), rel], capture_output=True, timeout=120)
                assert r.returncode == 0, r.stderr
                assert r.stdout == read_bytes(m.path / rel), rel
            assert read_bytes(m.path / f"{tree_path(n)}.raw") == arrays[n].tobytes(), n


def test_python_package_equals_orbax_restore(copies, restored):
    ckptfs = pytest.importorskip("ckptfs")
    step, arrays = restored("v0_f32")
    ck = ckptfs.open(str(copies("v0_f32") / "ckpt"))
    assert ck.info()["family"] == "orbax" and ck.info()["step"] == step
    for name, a in arrays.items():
        fqn, state = fqn_state(name)
        got = ck.read(fqn, state=state or "param")
        assert got.dtype == a.dtype and got.shape == a.shape and got.tobytes() == a.tobytes(), name
    # bfloat16: float32 widens exactly
    _, arrays = restored("v0_bf16")
    bf = ckptfs.open(str(copies("v0_bf16") / "ckpt"))
    for name, a in arrays.items():
        fqn, state = fqn_state(name)
        got = bf.read(fqn, state=state or "param", dtype="float32" if is_bf16(a) else None)
        w = widened(a)
        assert got.dtype == w.dtype and got.tobytes() == w.tobytes(), name


def test_python_package_reads_bf16_as_ml_dtypes(copies, restored):
    """orbax restores bfloat16 as ml_dtypes.bfloat16 numpy arrays; the package says
    it gives numpy bfloat16 when ml_dtypes is installed (jax installs it)."""
    ckptfs = pytest.importorskip("ckptfs")
    pytest.importorskip("ml_dtypes")
    _, arrays = restored("v0_bf16")
    bf = ckptfs.open(str(copies("v0_bf16") / "ckpt"))
    for name in ("params.output", "opt_state.0.mu.norm"):
        a = arrays[name]
        assert is_bf16(a)
        fqn, state = fqn_state(name)
        got = bf.read(fqn, state=state)
        assert got.dtype == a.dtype and got.shape == a.shape and got.tobytes() == a.tobytes(), name


def test_python_package_names_every_entry(copies):
    """Every entry of the tree has its name: the four other/ entries of an orbax
    step are opt_state.0.count, _METADATA, _sharding and _CHECKPOINT_METADATA."""
    ckptfs = pytest.importorskip("ckptfs")
    ck = ckptfs.open(str(copies("v0_f32") / "ckpt"))
    others = sorted(t.name for t in ck.tensors() if t.role == "other")
    assert others == sorted(["opt_state.0.count", "_METADATA", "_sharding", "_CHECKPOINT_METADATA"]), others
    assert set(others) <= set(n.removesuffix(".npy").removesuffix(".raw") for n in ck.listdir("other"))


# ---------------------------------------------------------------- 3. torch's DCP reader on dcp/

def torch_bytes(t):
    """The bytes of a torch tensor (bfloat16 included), C order."""
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("name", FIXTURES)
def test_torch_dcp_load_from_dcp_view(name, copies, restored, mounter):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    _, arrays = restored(name)
    tdtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "int32": torch.int32}
    sd = {"model": {}, "optim": {"state": {}}}
    where = {}
    for n, a in arrays.items():
        t = torch.full(a.shape, 7, dtype=tdtype[a.dtype.name])  # never the right values
        fqn, state = fqn_state(n)
        if state == "param":
            sd["model"][fqn] = t
        elif state:
            sd["optim"]["state"].setdefault(fqn, {})[state] = t
        else:
            sd[n] = t
        where[n] = t
    with mounter(copies(name) / "ckpt") as m:
        md = FileSystemReader(str(m.path / "dcp")).read_metadata()
        assert {f"model.{fqn_state(n)[0]}" for n in arrays if n.startswith("params.")} <= set(md.state_dict_metadata)
        dcp.load(sd, storage_reader=FileSystemReader(str(m.path / "dcp")), no_dist=True)
    for n, a in arrays.items():
        t = where[n]
        assert t.dtype == tdtype[a.dtype.name] and tuple(t.shape) == a.shape, n
        assert torch_bytes(t) == a.tobytes(), n


def test_dcp_to_torch_save_of_dcp_view(copies, restored, mounter, tmp_path):
    """torch's dcp_to_torch_save reads every key of dcp/ (bytes entries included,
    which torch's planner torch.load()s): it must work on an Orbax mount too, and
    give orbax's tensors."""
    torch = pytest.importorskip("torch")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    _, arrays = restored("v0_bf16")
    with mounter(copies("v0_bf16") / "ckpt") as m:
        dcp_to_torch_save(str(m.path / "dcp"), str(tmp_path / "out.pt"))
    sd = torch.load(tmp_path / "out.pt", weights_only=False)
    for n, a in arrays.items():
        fqn, state = fqn_state(n)
        t = sd["model"][fqn] if state == "param" else sd["optim"]["state"][fqn][state] if state else sd[n]
        assert torch_bytes(t) == a.tobytes(), n


# ---------------------------------------------------------------- 4. verify, damaged copies

@pytest.mark.parametrize("name", FIXTURES)
def test_verify_clean_and_deep_norms(name, copies, restored, bin_path):
    _, arrays = restored(name)
    src = copies(name) / "ckpt"
    r = run([bin_path, "verify", str(src)])
    assert r.returncode == 0 and "verdict: clean (exit 0)" in r.stdout, r.stdout + r.stderr
    r = run([bin_path, "verify", "--deep", "--json", str(src)])
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["verdict"] == "clean" and rep["findings"] == [] and rep["deep"]
    by_key = {t["key"]: t for t in rep["tensors"]}
    for n, a in arrays.items():
        t = by_key[n]
        assert t["read"] and t["dtype"] == a.dtype.name and t["shape"] == list(a.shape), n
        if a.dtype.kind == "f" or is_bf16(a):
            f = a.astype(np.float64)
            assert t["nan"] == 0 and t["inf"] == 0, n
            assert t["l2_norm"] == pytest.approx(float(np.sqrt((f * f).sum())), rel=1e-6), n
            assert t["max_abs"] == pytest.approx(float(np.abs(f).max()), rel=1e-7), n


def tensorstore_unreadable(item_dir):
    """Param names whose values tensorstore itself cannot read from the OCDBT
    database of `item_dir` (the independent judge of what a damage broke)."""
    ts = pytest.importorskip("tensorstore")
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item_dir}/"}).result()
    bad = set()
    for k in kv.list().result():
        try:
            kv.read(k).result()
        except Exception:  # noqa: BLE001 - any failure of tensorstore's read
            bad.add(k.decode().split("/")[0])
    return bad


TRUNCATED = "ocdbt.process_0/d/41200b6ce82f18f11085070c33884eac"  # holds out-of-line zarr chunks of step 2


@pytest.fixture
def truncated_value_file(tmp_path):
    src = tmp_path / "v0_f32"
    shutil.copytree(DATA / "v0_f32", src)
    item = src / "ckpt" / "2" / "default"
    f = item / TRUNCATED
    assert f.stat().st_size > 6204
    os.truncate(f, 2000)
    return src / "ckpt", item, f


def test_truncated_ocdbt_data_file_verify_and_eio(truncated_value_file, restored, mounter, bin_path):
    """A truncated OCDBT data file: exactly the arrays tensorstore cannot read are
    reported by verify (exit 1, naming the file) and answer EIO; every other file
    reads as orbax restores it (the same tensor's other states included)."""
    root, item, f = truncated_value_file
    _, arrays = restored("v0_f32")
    bad = tensorstore_unreadable(item)
    assert bad and bad < set(arrays), bad
    r = run([bin_path, "verify", "--json", str(root)])
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr
    rep = json.loads(r.stdout)
    assert rep["verdict"] == "unreadable"
    unread = [x for x in rep["findings"] if x["check"] == "unreadable"]
    assert {x["tensor"] for x in unread} == bad, unread
    assert all(f.name in x["message"] for x in unread), unread
    with mounter(root) as m:
        for n in bad:
            for ext in ("raw", "npy"):
                assert errno_of(m.path / f"{tree_path(n)}.{ext}") == errno.EIO, n
        check_tree(m.path, arrays, item, step_dir=item.parent, skip=bad)
        assert f.name in m.log_text()


def test_truncated_ocdbt_data_file_is_named_by_info(truncated_value_file, bin_path):
    """As for every other family (a truncated DCP shard, a truncated Megatron rank
    file; verify.md: "an item past the end of its file ... checkpoint.json lists
    them under broken"): `ckptfs info` exits 1 naming the file, and
    checkpoint.json lists the tensors under broken."""
    root, item, f = truncated_value_file
    bad = tensorstore_unreadable(item)
    r = run([bin_path, "info", str(root)])
    assert r.returncode == 1 and f.name in r.stderr, (r.returncode, r.stderr[-2000:])
    cj = json.loads(run([bin_path, "cat", str(root), "checkpoint.json"]).stdout)
    assert all(n in json.dumps(cj["broken"]) for n in bad), cj["broken"]


def test_truncated_ocdbt_btree_node_is_named(tmp_path, bin_path):
    """The merged B+tree node (the only file of ckpt/2/default/d/) cut short: info,
    verify and mount exit 1 naming it; nothing crashes."""
    src = tmp_path / "v0_f32"
    shutil.copytree(DATA / "v0_f32", src)
    (node,) = (src / "ckpt" / "2" / "default" / "d").iterdir()
    os.truncate(node, node.stat().st_size // 2)
    for cmd in (["info"], ["verify"], ["verify", "--deep"]):
        r = run([bin_path, *cmd, str(src / "ckpt")])
        assert r.returncode == 1, (cmd, r.returncode, r.stderr)
        assert f"d/{node.name}" in r.stderr and "OCDBT" in r.stderr, (cmd, r.stderr)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = run([bin_path, "mount", str(src / "ckpt"), str(mnt), "--log", str(tmp_path / "m.log")], timeout=60)
    assert r.returncode == 1 and node.name in r.stderr and not os.path.ismount(mnt), r.stderr


def test_deleted_zarr_chunk_no_ocdbt(tmp_path, restored, mounter, bin_path):
    _, arrays = restored("no_ocdbt_zarr2")
    src = tmp_path / "z2"
    shutil.copytree(DATA / "no_ocdbt_zarr2", src)
    root = src / "ckpt"
    item = root / "2" / "default"
    victim = "params.layers.layers_1.attention.wk"
    chunk = item / victim / "1.2"
    chunk.unlink()
    r = run([bin_path, "verify", "--json", str(root)])
    assert r.returncode == 3, r.stdout[-2000:] + r.stderr
    rep = json.loads(r.stdout)
    cov = [x for x in rep["findings"] if x["check"] == "coverage"]
    assert cov and {x["tensor"] for x in cov} == {victim}, cov
    assert any(f"{victim}/1.2" in x["message"] for x in cov), cov
    r = run([bin_path, "cat", str(root), "checkpoint.json"])
    cj = json.loads(r.stdout)
    assert any(f"{victim}/1.2" in p and "missing" in p for p in cj["problems"]), cj["problems"]
    with mounter(root) as m:
        for ext in ("raw", "npy"):
            assert errno_of(m.path / f"{tree_path(victim)}.{ext}") == errno.EIO
        check_tree(m.path, arrays, item, step_dir=item.parent, skip={victim})
        # the log names the tensor and the hole (the chunk file is named by verify and checkpoint.json)
        assert f"cannot read '{victim}'" in m.log_text() and "hole" in m.log_text()


# ---------------------------------------------------------------- 5. only an unfinished save

def test_only_an_unfinished_save_is_refused_and_nothing_written(tmp_path, bin_path):
    d = tmp_path / "only_tmp"
    d.mkdir()
    shutil.copytree(DATA / "tmp_step" / "ckpt" / "3.orbax-checkpoint-tmp", d / "3.orbax-checkpoint-tmp")
    os.utime(d, (time.time() - 60, time.time() - 60))
    stamp = tmp_path / "stamp"
    stamp.write_text("")
    os.utime(stamp, (time.time() - 30, time.time() - 30))  # after every copied file, before the commands
    for cmd in (["info"], ["verify"], ["ls"]):
        r = run([bin_path, *cmd, str(d)])
        assert r.returncode == 1, (cmd, r.returncode, r.stdout[-500:], r.stderr)
        assert "cannot detect" in r.stderr and "orbax-checkpoint-tmp saves are never read" in r.stderr, (cmd, r.stderr)
    written = subprocess.run(["find", str(d), "-newer", str(stamp)], capture_output=True, text=True).stdout
    assert written == "", written


# ---------------------------------------------------------------- 6. tensorstore's own OCDBT listing

@pytest.mark.parametrize("name", OCDBT)
def test_tensorstore_ocdbt_listing_equals_committed(name, copies):
    ts = pytest.importorskip("tensorstore")
    item = copies(name) / "ckpt" / "2" / item_name(name)
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item}/"}).result()
    listing = {k.decode(): len(kv.read(k).result().value) for k in kv.list().result()}
    committed = json.loads((DATA / name / "ts_listing.json").read_text())
    assert set(listing) == set(committed), sorted(set(listing) ^ set(committed))[:10]
    assert listing == committed

"""The Python package (python/ckptfs, scripts/test.sh installs it into .venv):
reads equal what the mount serves, boxes and dtypes, any file of the tree,
errors as exceptions naming the file, threads, a fresh venv without /dev/fuse,
and torch's own dcp.load through ckptfs.torch.StorageReader at world 2."""
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES, ROOT, run
from test_deepspeed_mount import produce

ckptfs = pytest.importorskip("ckptfs", reason="the ckptfs package is not installed (scripts/test.sh installs it)")
torch = pytest.importorskip("torch")
import ckptfs.torch as ctorch  # noqa: E402


@pytest.fixture(scope="module")
def ds_root(tmp_path_factory):
    base = os.environ.get("CKPTFS_FIXTURE_CACHE")
    return Path(base) / "deepspeed" if base else tmp_path_factory.mktemp("deepspeed")


@pytest.fixture(scope="module")
def z2(ds_root, tmp_path_factory):
    """DeepSpeed ZeRO-2, fp32, DP=2 (tests/fixtures/make_deepspeed.py), copied so
    its index lives in a directory of its own."""
    ck, _ = produce(ds_root, "z2_fp32_dp2")
    dst = tmp_path_factory.mktemp("pkg") / "z2"
    shutil.copytree(ck, dst, ignore=shutil.ignore_patterns(".ckptfs"))
    return dst


@pytest.fixture(scope="module")
def z1bf16(ds_root):
    ck, _ = produce(ds_root, "z1_bf16_dp4")
    return ck


def test_every_tensor_reads_as_the_mount_serves(z2, mounter):
    ck = ckptfs.open(z2)
    assert ck.info()["family"].startswith("deepspeed")
    tensors = ck.tensors()
    assert {t.role for t in tensors} >= {"param", "optim_state"}
    with mounter(z2) as m:
        for t in tensors:
            if t.role == "other" or t.dtype == "object":
                continue
            raw = (m.path / "params" / t.name / f"{t.state}.raw").read_bytes()
            a = ck.read(t.name, t.state)
            assert a.shape == t.shape and a.tobytes() == raw, (t.name, t.state)
            npy = np.load(m.path / "params" / t.name / f"{t.state}.npy")
            assert np.array_equal(npy, a)


def test_boxes_dtypes_and_out_buffers(z2, z1bf16):
    ck = ckptfs.open(z2)
    name = "language_model.encoder.layers.0.mlp.dense_h_to_4h.weight"
    full = ck.read(name, "exp_avg")
    assert np.array_equal(ck.read(name, "exp_avg", box=(slice(3, 9), slice(2, 5))), full[3:9, 2:5])
    assert np.array_equal(ck.read(name, "exp_avg", box=(slice(1, 2),)), full[1:2])
    out = torch.empty(full.shape, dtype=torch.float32)
    ck.read(name, "exp_avg", out=out)  # a torch tensor through DLPack
    assert np.array_equal(out.numpy(), full)
    pinned_ok = True
    try:
        pinned = torch.empty(full.shape, dtype=torch.float32, pin_memory=True)
    except RuntimeError:  # no CUDA driver: no pinned memory on this machine
        pinned_ok = False
    if pinned_ok:
        ck.read(name, "exp_avg", out=pinned)
        assert np.array_equal(pinned.numpy(), full)
    with pytest.raises(TypeError, match="element type"):
        ck.read(name, "exp_avg", out=np.empty(full.shape, np.float64))
    with pytest.raises(ValueError, match="elements"):
        ck.read(name, "exp_avg", box=(slice(0, 2),), out=np.empty(full.shape, np.float32))
    # Buffers the read could not land in as given are refused, never filled through a copy.
    with pytest.raises(TypeError):
        ck.read(name, "exp_avg", out=np.empty((full.shape[0], full.shape[1] * 2), np.float32)[:, ::2])
    frozen = np.zeros(full.shape, np.float32)
    frozen.flags.writeable = False
    with pytest.raises((TypeError, ValueError)):
        ck.read(name, "exp_avg", out=frozen)
    assert not frozen.any()
    with pytest.raises(KeyError, match="states: exp_avg, exp_avg_sq, fp32, param"):
        ck.read(name, "momentum")
    with pytest.raises(KeyError):
        ck.read("no.such.weight")

    # bfloat16: torch tensors hold it, numpy refuses it by name, float32 widens exactly.
    bf = ckptfs.open(z1bf16)
    t = next(t for t in bf.tensors() if t.dtype == "bfloat16" and t.role == "param")
    as_bf16 = ctorch.read(bf, t.name)
    assert as_bf16.dtype == torch.bfloat16 and tuple(as_bf16.shape) == t.shape
    assert torch.equal(ctorch.read(bf, t.name, dtype=torch.float32), as_bf16.float())
    assert np.array_equal(bf.read(t.name, dtype="float32"), as_bf16.float().numpy())
    if "bfloat16" in ckptfs._NUMPY:  # ml_dtypes installed (jax brings it): numpy arrays of its bfloat16
        got = bf.read(t.name)
        assert got.dtype == ckptfs._NUMPY["bfloat16"] and got.shape == t.shape
        assert np.array_equal(got.view(np.uint16), as_bf16.view(torch.int16).numpy().view(np.uint16))
    else:
        with pytest.raises(TypeError, match="numpy has no bfloat16"):
            bf.read(t.name)
    # float32 rounds to bfloat16 / float16 as torch's .to() does (nearest even);
    # numpy's own float16 cast agrees. Other conversions are refused by name.
    full_t = torch.from_numpy(full)
    assert torch.equal(ctorch.read(ck, name, "exp_avg", dtype=torch.bfloat16), full_t.to(torch.bfloat16))
    into = torch.empty(full.shape, dtype=torch.bfloat16)
    ck.read(name, "exp_avg", box=None, dtype="bfloat16", out=into)
    assert torch.equal(into, full_t.to(torch.bfloat16))
    half = ck.read(name, "exp_avg", dtype="float16")
    assert half.dtype == np.float16 and np.array_equal(half.view(np.uint16), full.astype(np.float16).view(np.uint16))
    with pytest.raises(ckptfs.Error, match="cannot render float32 as int32"):
        ck.read(name, "exp_avg", dtype="int32")


def test_device_reads_without_a_gpu_say_why(z2):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present (test_device_reads_fill_cuda_tensors runs)")
    ck = ckptfs.open(z2)
    with pytest.raises(ckptfs.Error, match="cannot read into CUDA device 0: .*(CUDA|cuda)"):
        ck.device_info(0)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device here (bench/gpu_check.sh runs device reads on a lent GPU)")
def test_device_reads_fill_cuda_tensors(z2, z1bf16):
    """Reads into GPU memory (the merge / strip / widen on the device) equal the host reads:
    whole, boxes, widened, into a given CUDA tensor, and through dcp.load's StorageReader."""
    import torch.distributed.checkpoint as dcp

    assert ckptfs.open(z2).device_info(0)["kernels_trusted"]
    for src in (z2, z1bf16):
        ck = ckptfs.open(src)
        for t in ck.tensors():
            if t.dtype == "object" or t.error:
                continue
            host = ctorch.read(ck, t.name, t.state)
            dev = ctorch.read(ck, t.name, t.state, device="cuda")
            assert dev.is_cuda and torch.equal(dev.cpu(), host), (t.name, t.state)
            if t.dtype == "bfloat16":
                assert torch.equal(ctorch.read(ck, t.name, t.state, dtype="float32", device="cuda").cpu(), host.float())
            if len(t.shape) == 2 and t.shape[1] > 1:
                box = (slice(None), slice(t.shape[1] // 2, t.shape[1]))
                assert torch.equal(ctorch.read(ck, t.name, t.state, box=box, device="cuda").cpu(), host[box])
        sd = {t.name: torch.zeros(t.shape, dtype=torch.float32, device="cuda")
              for t in ck.tensors() if t.role == "param" and t.dtype != "object"}
        dcp.load(sd, storage_reader=ctorch.StorageReader(src), no_dist=True)
        for k, v in sd.items():
            assert torch.equal(v.cpu(), ctorch.read(ck, k).float()), k
        assert ck.stats()["gpu_fallbacks"] == 0


def test_any_file_of_the_tree(z2, mounter):
    from safetensors.torch import load as st_load
    ck = ckptfs.open(z2)
    assert "params" in ck.listdir("") and "topo" in ck.listdir("")
    with mounter(z2) as m:
        for rel in ["checkpoint.json", "universal/zero/language_model.encoder.final_layernorm.bias/fp32.pt",
                    "params/language_model.embedding.word_embeddings.weight/info.json"]:
            with ck.open_file(rel) as f:
                assert f.read() == (m.path / rel).read_bytes(), rel
        views = [v for v in ck.listdir("topo") if v.startswith("tp")]
        assert views, ck.listdir("topo")
        files = [f for f in ck.listdir(f"topo/{views[0]}") if f.endswith(".safetensors")]
        rel = f"topo/{views[0]}/{files[0]}"
        with ck.open_file(rel) as f:
            data = f.read()
            f.seek(100)
            assert f.read(50) == data[100:150]
        assert data == (m.path / rel).read_bytes() and ck.getsize(rel) == len(data)
        tensors = st_load(data)
        assert tensors
    # torch.load straight from the view file object (seeks, reads in pieces).
    with ck.open_file("universal/zero/language_model.encoder.final_layernorm.bias/exp_avg.pt") as f:
        obj = torch.load(f, weights_only=False)
    assert np.array_equal(obj["param"].numpy(), ck.read("language_model.encoder.final_layernorm.bias", "exp_avg"))
    with pytest.raises(FileNotFoundError):
        ck.open_file("params/nothing/param.raw")


def test_threads_read_the_same_bytes(z2):
    ck = ckptfs.open(z2)
    ts = [t for t in ck.tensors() if t.role != "other"]
    want = {(t.name, t.state): ck.read(t.name, t.state).tobytes() for t in ts}
    bad = []

    def worker(k):
        for t in ts[k::2] + ts:
            if ck.read(t.name, t.state).tobytes() != want[(t.name, t.state)]:
                bad.append((t.name, t.state))
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not bad
    assert ck.stats()["reads"] >= 5 * len(ts)


def test_damaged_sources_raise_naming_the_file(z2, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(z2, bad, ignore=shutil.ignore_patterns(".ckptfs"))
    optim = next((bad / "global_step2").glob("*optim_states.pt"))
    optim.write_bytes(optim.read_bytes()[:2000])
    ck = ckptfs.open(bad)
    broken = [t for t in ck.tensors() if t.error]
    assert broken and all(optim.name in t.error for t in broken)
    with pytest.raises(ckptfs.Error, match=optim.name) as e:
        ck.read(broken[0].name, broken[0].state)
    assert isinstance(e.value, OSError)
    intact = next(t for t in ck.tensors() if t.role == "param" and not t.error)
    assert np.array_equal(ck.read(intact.name), ckptfs.open(z2).read(intact.name))
    with pytest.raises(ckptfs.Error, match="cannot"):
        ckptfs.open(tmp_path / "missing")
    # A source replaced after indexing: the read is refused, never stale bytes.
    changed = tmp_path / "changed"
    shutil.copytree(z2, changed, ignore=shutil.ignore_patterns(".ckptfs"))
    ck = ckptfs.open(changed)
    t = next(t for t in ck.tensors() if t.role == "param")
    model = changed / "global_step2" / "mp_rank_00_model_states.pt"
    model.write_bytes(model.read_bytes() + b"\0")
    with pytest.raises(ckptfs.Error, match="mp_rank_00_model_states.pt"):
        ck.read(t.name)


def test_verify_report(z2):
    rep = ckptfs.open(z2).verify()
    assert rep["verdict"] == "clean" and rep["findings"] == [] and len(rep["tensors"]) > 100, rep


def test_imports_in_a_fresh_venv_without_dev_fuse(z2, tmp_path):
    """The wheel scripts/test.sh built, installed into a fresh venv, used in a
    mount namespace whose /dev has no fuse device."""
    wheels = sorted((ROOT / "build-py" / "wheel").glob("ckptfs-*.whl"))
    if not wheels:
        pytest.skip("no wheel in build-py/wheel (scripts/test.sh builds it)")
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) to hide /dev/fuse")
    venv = tmp_path / "venv"
    r = run([sys.executable, "-m", "venv", str(venv)])
    assert r.returncode == 0, r.stderr
    py = venv / "bin" / "python"
    numpy_pin = next(line.split("==")[1].strip() for line in (ROOT / "scripts" / "constraints.txt").read_text().split()
                     if line.lower().startswith("numpy=="))
    r = run([str(py), "-m", "pip", "install", "-q", str(wheels[-1]), f"numpy=={numpy_pin}"], timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    script = (
        "import os, ckptfs, sys\n"
        "assert not os.path.exists('/dev/fuse')\n"
        f"ck = ckptfs.open({str(z2)!r}, index={str(tmp_path / 'idx')!r})\n"
        "t = next(t for t in ck.tensors() if t.role == 'param')\n"
        "print(ck.info()['family'], t.name, float(ck.read(t.name).sum()))\n")
    r = run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs none /dev && exec {py} -c \"$0\"", script])
    assert r.returncode == 0, r.stdout + r.stderr
    family, name, total = r.stdout.split()
    assert family.startswith("deepspeed") and float(total) == float(ckptfs.open(z2).read(name).sum())


def test_dcp_load_non_tensor_entries_like_torchs_reader(dcp_fsdp2_w3):
    """Bytes entries (param_groups values, here) load through the StorageReader
    as through torch's own FileSystemReader; a key the checkpoint lacks is
    refused unless the load is partial."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    keys = [t.name for t in ckptfs.open(dcp_fsdp2_w3).tensors() if t.dtype == "object"]
    assert "optimizer.param_groups.0.lr" in keys
    mine = {k: None for k in keys}
    theirs = {k: None for k in keys}
    dcp.load(mine, storage_reader=ctorch.StorageReader(dcp_fsdp2_w3), no_dist=True)
    dcp.load(theirs, storage_reader=dcp.FileSystemReader(str(dcp_fsdp2_w3)), no_dist=True)
    assert mine == theirs and mine["optimizer.param_groups.0.lr"] == theirs["optimizer.param_groups.0.lr"] > 0
    with pytest.raises(BaseException) as e:  # torch's CheckpointException (a BaseException): the cause per rank
        dcp.load({"optim.param_groups.0.lr": 0.0}, storage_reader=ctorch.StorageReader(dcp_fsdp2_w3), no_dist=True)
    assert "Missing key in checkpoint state_dict: optim.param_groups.0.lr" in str(e.value.failures[0])
    partial = {"optim.param_groups.0.lr": 0.5}
    dcp.load(partial, storage_reader=ctorch.StorageReader(dcp_fsdp2_w3), no_dist=True,
             planner=DefaultLoadPlanner(allow_partial_load=True))
    assert partial == {"optim.param_groups.0.lr": 0.5}


def resume(src, params_from, tmp_path, groups="one", view="dcp"):
    """Runs tests/fixtures/dcp_load_worker.py at world 2; returns what rank 0 saved."""
    out = tmp_path / "loaded.pt"
    r = subprocess.run([sys.executable, str(FIXTURES / "dcp_load_worker.py"), "--src", str(src), "--out", str(out),
                        "--world", "2", "--params-from", params_from, "--groups", groups, "--view", view],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return torch.load(out, weights_only=False)


def megatron_fixture(tmp_path_factory, name):
    from conftest import make_megatron_fixtures
    from test_megatron_mount import SCENARIOS
    cache = os.environ.get("CKPTFS_FIXTURE_CACHE")
    root = Path(cache) / "megatron" if cache else tmp_path_factory.mktemp("megatron")
    return make_megatron_fixtures(root, {name: SCENARIOS[name]}) / name


@pytest.fixture(scope="module")
def megatron_tp2_pp2(tmp_path_factory):
    return megatron_fixture(tmp_path_factory, "legacy_tp2_pp2")


@pytest.fixture(scope="module")
def megatron_dist(tmp_path_factory):
    return megatron_fixture(tmp_path_factory, "dist_tp2_pp2_dp2")


@pytest.fixture(scope="module")
def dcp_fsdp2_w3(dcp_fixtures):
    return dcp_fixtures / "fsdp2_w3"


@pytest.fixture(scope="module")
def megatron_llama(tmp_path_factory):
    from test_hf_mount import HF_SCENARIOS
    from conftest import make_megatron_fixtures
    cache = os.environ.get("CKPTFS_FIXTURE_CACHE")
    root = Path(cache) / "megatron_hf" if cache else tmp_path_factory.mktemp("megatron_hf")
    name = "llama_legacy_tp2_pp2"
    return make_megatron_fixtures(root, {name: HF_SCENARIOS[name]}) / name


def test_dcp_load_hf_view_into_a_transformers_model_at_world_2(megatron_llama, tmp_path):
    """StorageReader(view="hf"): a transformers Llama built from hf/config.json,
    FSDP2 at world 2, dcp.load's the Megatron legacy TP=2 PP=2 checkpoint
    under Hugging Face names (fused QKV and SwiGLU fc1 split by hf/): every
    weight equals the hf/ safetensors, then a training step runs."""
    from safetensors.torch import load as st_load
    got = resume(megatron_llama, "hf", tmp_path)
    ck = ckptfs.open(megatron_llama)
    want = {}
    for f in ck.listdir("hf"):
        if f.endswith(".safetensors"):
            with ck.open_file(f"hf/{f}") as fh:
                want.update(st_load(fh.read()))
    assert want and set(want) <= set(got["params"]), sorted(set(want) - set(got["params"]))
    for k, v in want.items():
        assert torch.equal(got["params"][k], v), k
    assert any(".q_proj." in k for k in want) and any(".gate_proj." in k for k in want)
    assert got["stepped"]
    per_rank = got["source_bytes"]
    assert min(per_rank) > 0 and max(per_rank) < 0.75 * sum(per_rank), per_rank


def test_torchtitan_model_resumes_from_megatron_at_world_2(megatron_llama, tmp_path):
    """torchtitan's own Llama 3 model (FSDP2, world 2) loads the Megatron Llama
    TP=2 PP=2 checkpoint the way torchtitan's checkpointer loads Hugging Face
    weights: its Llama3StateDictAdapter.to_hf names the keys, dcp.load reads
    them through StorageReader(view="hf"), from_hf undoes the RoPE row
    permutation. Its parameters equal from_hf of the hf/ tensors, and its
    logits equal transformers' on the same weights."""
    pytest.importorskip("torchtitan")
    from safetensors.torch import load as st_load
    from transformers import AutoModelForCausalLM
    got = resume(megatron_llama, "torchtitan", tmp_path)
    ck = ckptfs.open(megatron_llama)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    hf = {}
    for f in ck.listdir("hf"):
        with ck.open_file(f"hf/{f}") as fh:
            (hf_dir / f).write_bytes(fh.read())
        if f.endswith(".safetensors"):
            hf.update(st_load((hf_dir / f).read_bytes()))
    sys.path.insert(0, str(FIXTURES))
    try:
        from dcp_load_worker import torchtitan_llama
    finally:
        sys.path.pop(0)
    import json
    _, adapter = torchtitan_llama(json.loads((hf_dir / "config.json").read_text()))
    want = adapter.from_hf(dict(hf))
    assert set(want) == set(got["params"]), sorted(set(want) ^ set(got["params"]))
    for k, v in want.items():
        assert torch.equal(got["params"][k], v.to(got["params"][k].dtype)), k
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    tokens = (torch.arange(32).reshape(2, 16) * 7 + 3) % model.config.vocab_size
    with torch.no_grad():
        ref = model(tokens).logits
    assert torch.allclose(got["logits"], ref, atol=1e-5, rtol=1e-5), (got["logits"] - ref).abs().max()
    assert got["stepped"]


LOAD_CASES = {"deepspeed_z2_dp2": ("z2", "param"), "megatron_legacy_tp2_pp2": ("megatron_tp2_pp2", "fp32"),
              "megatron_torch_dist_tp2_pp2_dp2": ("megatron_dist", "fp32"), "dcp_fsdp2_w3": ("dcp_fsdp2_w3", "param")}


# view="params" takes the model's own copy: an fp32 run's (bf16 weights would
# not all move by one step of lr 1e-3, e.g. norms at 1.0).
@pytest.mark.parametrize("name, view", [("legacy_tp2_pp2", "dcp"), ("legacy_distopt_tp2_dp2", "dcp"),
                                        ("dist_tp2_pp2_dp2", "dcp"), ("legacy_tp1_pp1", "params")])
def test_megatron_param_groups_reach_a_torch_optimizer(name, view, tmp_path_factory, tmp_path):
    """A Megatron run's two param groups (weight decay or not, told apart by
    wd_mult; the distributed optimizer saves no member ids) reach an FSDP2
    AdamW at world 2 grouped as Megatron groups, through StorageReader's
    view="dcp" and its default view="params" keys: set_state_dict maps each
    saved group onto the loader's group by its members' FQNs, so each takes
    the source's hyperparameters (lr 1e-3, not the loader's 1e-2)."""
    from conftest import megatron_saved_param_groups
    src = megatron_fixture(tmp_path_factory, name)
    got = resume(src, "fp32" if view == "dcp" else "param", tmp_path, groups="megatron", view=view)
    saved = megatron_saved_param_groups(src)[0]
    assert [g["wd_mult"] for g in saved] == [1.0, 0.0]
    assert len(got["groups"]) == 2
    for g, want in zip(got["groups"], saved):
        for k in ("lr", "betas", "eps", "weight_decay", "wd_mult"):
            assert g[k] == want[k], (k, g[k], want[k])
    assert got["groups"][0]["lr"] == 1e-3
    assert got["stepped"]


@pytest.mark.parametrize("case", sorted(LOAD_CASES))
def test_dcp_load_into_fsdp2_at_world_2(case, request, tmp_path):
    """torch's dcp.load through ckptfs.torch.StorageReader: an FSDP2 model and
    its AdamW at world 2 (gloo, CPU) take a DeepSpeed ZeRO-2 DP=2 checkpoint,
    a DCP saved by FSDP2 at world 3 (the model's parameters), or a Megatron
    legacy TP=2 PP=2 / torch_dist TP=2 PP=2 DP=2 bf16 one (its fp32 masters,
    through a key_map), compared exactly with what params/ serves, then train
    a step."""
    src, params_from = LOAD_CASES[case]
    src = request.getfixturevalue(src)
    got = resume(src, params_from, tmp_path)
    ck = ckptfs.open(src)
    params = [t for t in ck.tensors() if t.state == params_from]
    assert set(got["params"]) == {t.name for t in params}
    trained = {t.name for t in ck.tensors() if t.state == "exp_avg"}
    stepped = {t.name for t in ck.tensors() if t.state == "step"}
    assert set(got["optim"]) == trained and len(trained) >= len(params) - 1  # DeepSpeed: position_embeddings frozen
    for t in params:
        assert torch.equal(got["params"][t.name], ctorch.read(ck, t.name, params_from)), t.name
        if t.name not in trained:
            continue
        for state in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["optim"][t.name][state], ctorch.read(ck, t.name, state)), (t.name, state)
        if t.name in stepped:  # the optimizer's own count, where the checkpoint keeps one
            assert float(got["optim"][t.name]["step"]) == float(ck.read(t.name, "step"))
    assert got["stepped"]  # an optimizer step after the load ran and changed every trained weight
    # Each rank read about half of the source bytes (its Shard(0) boxes), not the whole tensors.
    per_rank = got["source_bytes"]
    assert len(per_rank) == 2 and min(per_rank) > 0 and max(per_rank) < 0.6 * sum(per_rank), per_rank

"""DCP's other on-disk layouts, written by torch itself (make_dcp.py variants_w2:
one FSDP2 model, 2 gloo ranks, one AdamW step, saved five ways), mounted and
compared with the producer's own full state (get_state_dict(full_state_dict=True)):

  ranklocal_w2           dcp.save(use_collectives=False): __<rank>.metadata, no .metadata
  st_format_w2           FileSystemWriter(serialization_format=SAFETENSORS)
  hf_storage_w2          HuggingFaceStorageWriter consolidated files + index.json
  hf_storage_w2/sharded  its per-rank shards (DCP_SHARDING_INFO)
  hf_sharded_w2          HuggingFaceStorageWriter(save_distributed=True) shards alone

plus Accelerate's FSDP layouts (make_accelerate.py: accelerate's save_fsdp_model /
save_fsdp_optimizer, what HF Trainer's checkpoint-N/ holds): SHARDED_STATE_DICT
(pytorch_model_fsdp_0/ + optimizer_0/, mounted as one checkpoint) and
FULL_STATE_DICT (pytorch_model_fsdp.bin + optimizer.bin), the per-rank files of
use_dcp=False and LOCAL_STATE_DICT (FSDP1 ShardedTensors, FSDP2 DTensors), and plain torch.save
files (torch's own dcp_to_torch_save output); for each, damage that must be
named, not served."""
import errno
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT, ckptfs_bin, run

FULL_DCP = ["ranklocal_w2", "st_format_w2"]
HF_STORAGE = ["hf_storage_w2", "hf_storage_w2/sharded", "hf_sharded_w2"]


@pytest.fixture(scope="module")
def full(dcp_fixtures):
    return torch.load(dcp_fixtures / "variants_w2.full.pt", weights_only=False)


def npy(mnt, rel):
    return np.load(mnt.path / rel)


@pytest.mark.parametrize("variant", FULL_DCP)
def test_model_and_optimizer_equal_the_full_state(variant, dcp_fixtures, full, mounter, tmp_path):
    src = dcp_fixtures / variant
    with mounter(src, index=tmp_path / "ix") as m:
        info = json.loads((m.path / "checkpoint.json").read_text())
        assert info["family"] == "pytorch-dcp", info
        n = 0
        for fqn, ref in full["model"].items():
            got = npy(m, f"params/{fqn}/param.npy")
            np.testing.assert_array_equal(got, ref.numpy(), err_msg=fqn)
            n += 1
            for state, sref in full["optimizer"]["state"][fqn].items():
                got = npy(m, f"params/{fqn}/{state}.npy")
                np.testing.assert_array_equal(got, sref.numpy(), err_msg=f"{fqn} {state}")
                n += 1
        assert n == 6 + 6 * 3
        assert torch.load(m.path / "other/train_state.step", weights_only=False) == 1
        # The exact bytes of both ranks' rows, merged (cmp-able against any copy).
        raw = (m.path / "params/embed.weight/param.raw").read_bytes()
        assert raw == full["model"]["embed.weight"].numpy().tobytes()


def test_rank_local_is_recognised_as_such(dcp_fixtures, tmp_path):
    r = run([ckptfs_bin(), "info", str(dcp_fixtures / "ranklocal_w2"), "--index", str(tmp_path / "ix")])
    assert r.returncode == 0, r.stderr
    assert "rank-local: 2 __<rank>.metadata files" in r.stdout and "ranks       2" in r.stdout, r.stdout


@pytest.mark.parametrize("variant", HF_STORAGE)
def test_hf_storage_writer_output_equals_the_model(variant, dcp_fixtures, full, mounter, tmp_path):
    from safetensors.numpy import load_file

    src = dcp_fixtures / variant
    with mounter(src, index=tmp_path / "ix") as m:
        info = json.loads((m.path / "checkpoint.json").read_text())
        assert info["family"] == "safetensors", info
        names = sorted(os.listdir(m.path / "params"))
        assert names == sorted(full["model"]), names
        for fqn, ref in full["model"].items():
            np.testing.assert_array_equal(npy(m, f"params/{fqn}/param.npy"), ref.numpy(), err_msg=fqn)
        # The consolidated file torch wrote, read by safetensors itself, equals
        # what the mount serves for the shards.
        if variant != "hf_sharded_w2":
            consolidated = load_file(dcp_fixtures / "hf_storage_w2" / "model-00001-of-00001.safetensors")
            for fqn, arr in consolidated.items():
                np.testing.assert_array_equal(npy(m, f"params/{fqn}/param.npy"), arr, err_msg=fqn)


def test_plain_hf_model_directory_exports_to_hf(dcp_fixtures, full, mounter, tmp_path):
    """A save_pretrained-style directory mounts as a checkpoint of its own; hf/
    re-exports it (names as they are) and safetensors reads the shards."""
    from safetensors.numpy import load_file

    src = tmp_path / "model"
    shutil.copytree(dcp_fixtures / "hf_storage_w2", src, ignore=shutil.ignore_patterns(".ckptfs", "sharded"))
    r = run([ckptfs_bin(), "info", str(src), "--index", str(tmp_path / "ix")])
    assert r.returncode == 0 and "Hugging Face safetensors, 1 file(s) (model.safetensors.index.json)" in r.stdout, r.stdout
    with mounter(src, index=tmp_path / "ix") as m:
        got = {}
        for f in sorted(os.listdir(m.path / "hf")):
            if f.endswith(".safetensors"):
                got.update(load_file(m.path / "hf" / f))
        assert sorted(got) == sorted(full["model"])
        for fqn, ref in full["model"].items():
            np.testing.assert_array_equal(got[fqn], ref.numpy(), err_msg=fqn)


def test_accelerate_fsdp_checkpoint_is_one_checkpoint(accelerate_fixtures, mounter, tmp_path):
    """checkpoint-N/ with pytorch_model_fsdp_0/ and optimizer_0/: the optimizer
    states sit under their parameters; everything equals the producer's full
    state and `accelerate merge-weights` (accelerate's own merger)."""
    from safetensors.numpy import load_file

    full = torch.load(accelerate_fixtures / "full.pt", weights_only=False)
    merged = tmp_path / "merged"
    subprocess.run([sys.executable, "-m", "accelerate.commands.accelerate_cli", "merge-weights",
                    str(accelerate_fixtures / "checkpoint-1" / "pytorch_model_fsdp_0"), str(merged)],
                   check=True, capture_output=True, timeout=300)
    by_accelerate = load_file(merged / "model.safetensors")
    assert sorted(by_accelerate) == sorted(full["model"])
    src = accelerate_fixtures / "checkpoint-1"
    r = run([ckptfs_bin(), "info", str(src), "--index", str(tmp_path / "ix")])
    assert r.returncode == 0 and "Accelerate FSDP: pytorch_model_fsdp_0/ + optimizer_0/" in r.stdout, r.stdout + r.stderr
    assert "step        1" in r.stdout
    with mounter(src, index=tmp_path / "ix") as m:
        for fqn, ref in full["model"].items():
            got = npy(m, f"params/{fqn}/param.npy")
            np.testing.assert_array_equal(got, ref.numpy(), err_msg=fqn)
            np.testing.assert_array_equal(got, by_accelerate[fqn], err_msg=fqn)
            for state, sref in full["optimizer"]["state"][fqn].items():
                np.testing.assert_array_equal(npy(m, f"params/{fqn}/{state}.npy"), sref.numpy(), err_msg=f"{fqn} {state}")


def test_accelerate_optimizer_dir_without_its_model_is_not_a_checkpoint(accelerate_fixtures, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(accelerate_fixtures / "checkpoint-1", ck, ignore=shutil.ignore_patterns(".ckptfs"))
    shutil.rmtree(ck / "pytorch_model_fsdp_0")
    r = run([ckptfs_bin(), "info", str(ck), "--index", str(tmp_path / "ix")])
    assert r.returncode == 1 and "cannot detect a checkpoint" in r.stderr, r.stderr


def test_accelerate_full_state_dict_files(accelerate_fixtures, mounter, tmp_path):
    full = torch.load(accelerate_fixtures / "full.pt", weights_only=False)
    src = accelerate_fixtures / "checkpoint-1-full"
    r = run([ckptfs_bin(), "info", str(src), "--index", str(tmp_path / "ix")])
    assert r.returncode == 0, r.stderr
    assert "torch-save (torch.save archives: pytorch_model_fsdp.bin, optimizer.bin)" in r.stdout, r.stdout
    with mounter(src, index=tmp_path / "ix") as m:
        for fqn, ref in full["model"].items():
            np.testing.assert_array_equal(npy(m, f"params/{fqn}/param.npy"), ref.numpy(), err_msg=fqn)
            for state, sref in full["optimizer"]["state"][fqn].items():
                np.testing.assert_array_equal(npy(m, f"params/{fqn}/{state}.npy"), sref.numpy(), err_msg=f"{fqn} {state}")
        # rng_state_*.pth and trainer_state.json are bookkeeping, not tensors.
        assert not (m.path / "other").exists() or not any("rng" in x for x in os.listdir(m.path / "other"))


@pytest.mark.parametrize("model,ck", [("fsdp1_w2", "checkpoint-1-rank"), ("fsdp1_w2", "checkpoint-1"),
                                      ("fsdp2_sharded_w2", "checkpoint-1-rank")])
def test_accelerate_per_rank_files_equal_the_full_state(model, ck, accelerate_fixtures, mounter, tmp_path):
    """save_fsdp_model / save_fsdp_optimizer with use_dcp=False: every rank
    torch.saves its ShardedTensors (FSDP1) or DTensors (FSDP2) as
    pytorch_model_fsdp_0_rank<R>.bin + optimizer_0_rank<R>.bin. Mounted, every
    parameter and AdamW state is merged and equals the producer's full state
    (FSDP1: FULL_STATE_DICT and a full FSDP.optim_state_dict); FSDP1 through
    DCP (ShardedTensors in .metadata) too."""
    base = accelerate_fixtures.parent / model
    full = torch.load(base / "full.pt", weights_only=False)
    src = base / ck
    r = run([ckptfs_bin(), "verify", str(src), "--index", str(tmp_path / "ix")])
    assert r.returncode == 0, r.stdout + r.stderr
    with mounter(src, index=tmp_path / "ix") as m:
        info = json.loads((m.path / "checkpoint.json").read_text())
        assert info["step"] == 1, info
        if ck == "checkpoint-1-rank":
            assert info["family"] == "accelerate-fsdp", info
            assert "2 ranks' pytorch_model_fsdp_0_rank*.bin + optimizer_0_rank*.bin" in info["format"], info
        n = 0
        for fqn, ref in full["model"].items():
            np.testing.assert_array_equal(npy(m, f"params/{fqn}/param.npy"), ref.numpy(), err_msg=fqn)
            for state, sref in full["optimizer"]["state"][fqn].items():
                np.testing.assert_array_equal(npy(m, f"params/{fqn}/{state}.npy"), sref.numpy(),
                                              err_msg=f"{fqn} {state}")
                n += 1
        assert len(full["model"]) == 6 and n == 18
        assert "error" not in m.log_text().lower()


def test_accelerate_fsdp1_local_state_dict_is_the_flat_parameter(accelerate_fixtures, mounter, tmp_path):
    """LOCAL_STATE_DICT keeps FSDP1's flat parameter: each rank's piece as a 1-D
    ShardedTensor. Mounted, the pieces are merged into the whole flat parameter
    (the per-parameter shapes are not in these files)."""
    base = accelerate_fixtures.parent / "fsdp1_w2"
    flat = torch.load(base / "full.pt", weights_only=False)["flat"]
    assert list(flat) == ["_flat_param"]
    with mounter(base / "checkpoint-1-local", index=tmp_path / "ix") as m:
        got = npy(m, "params/_flat_param/param.npy")
        np.testing.assert_array_equal(got, flat["_flat_param"].detach().numpy())
        assert got.size == sum(t.numel() for t in torch.load(base / "full.pt", weights_only=False)["model"].values())


@pytest.mark.parametrize("model", ["fsdp1_w2", "fsdp2_sharded_w2"])
def test_accelerate_per_rank_files_missing_or_damaged_are_named(model, accelerate_fixtures, mounter, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(accelerate_fixtures.parent / model / "checkpoint-1-rank", ck,
                    ignore=shutil.ignore_patterns(".ckptfs"))
    os.unlink(ck / "optimizer_0_rank1.bin")
    r = run([ckptfs_bin(), "verify", str(ck), "--json", "--index", str(tmp_path / "ix")])
    assert r.returncode != 0
    msgs = [f["message"] for f in json.loads(r.stdout)["findings"]]
    assert any("optimizer_0_rank1.bin is missing" in x for x in msgs), msgs
    with mounter(ck, index=tmp_path / "ix2") as m:
        # Rank 1's half of every moment is gone: EIO, never a half-filled file.
        with pytest.raises(OSError) as e:
            (m.path / "params/embed.weight/exp_avg.npy").read_bytes()
        assert e.value.errno == errno.EIO
        assert "embed.weight" in m.log_text()
        # The model files are whole: parameters are still served.
        assert npy(m, "params/embed.weight/param.npy").shape == (13, 6)
    # A truncated rank file: named, not a crash.
    shutil.copy(accelerate_fixtures.parent / model / "checkpoint-1-rank" / "optimizer_0_rank1.bin", ck)
    blob = (ck / "pytorch_model_fsdp_0_rank0.bin").read_bytes()
    (ck / "pytorch_model_fsdp_0_rank0.bin").write_bytes(blob[: len(blob) // 2])
    r = run([ckptfs_bin(), "verify", str(ck), "--json", "--index", str(tmp_path / "ix3")])
    assert r.returncode != 0
    assert "pytorch_model_fsdp_0_rank0.bin" in r.stdout, r.stdout


def test_dcp_to_torch_save_output_equals_the_dcp_it_came_from(dcp_fixtures, mounter, tmp_path):
    """torch's own DCP -> torch.save converter wrote model.pt from fsdp2_w3:
    mounting either gives byte-identical params/ files (cmp)."""
    src = dcp_fixtures / "torch_save"
    ref = torch.load(src / "model.pt", weights_only=False)
    with mounter(src, name="pt", index=tmp_path / "ix1") as a, \
            mounter(dcp_fixtures / "fsdp2_w3", name="dcp", index=tmp_path / "ix2") as b:
        n = 0
        for fqn, t in ref["model"].items():
            np.testing.assert_array_equal(npy(a, f"params/{fqn}/param.npy"), t.numpy(), err_msg=fqn)
            files = [f"params/{fqn}/param.raw"] + [f"params/{fqn}/{s}.raw" for s in ref["optimizer"]["state"][fqn]]
            for f in files:
                assert subprocess.run(["cmp", a.path / f, b.path / f]).returncode == 0, f
                n += 1
        assert n == 6 * 4


# ---------------------------------------------------------------- damage


def copy(dcp_fixtures, variant, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(dcp_fixtures / variant, dst, ignore=shutil.ignore_patterns(".ckptfs"))
    return dst


def test_rank_local_with_a_missing_rank_metadata_names_it(dcp_fixtures, mounter, tmp_path):
    ck = copy(dcp_fixtures, "ranklocal_w2", tmp_path)
    os.unlink(ck / "__1.metadata")
    r = run([ckptfs_bin(), "verify", str(ck), "--json", "--index", str(tmp_path / "ix")])
    assert r.returncode != 0
    rep = json.loads(r.stdout)
    msgs = [f["message"] for f in rep["findings"]]
    assert any("__1.metadata is missing (rank 1's data files are present)" in x for x in msgs), msgs
    with mounter(ck, index=tmp_path / "ix2") as m:
        # Sharded tensors lost rank 1's half: EIO, never a half-filled file.
        with pytest.raises(OSError) as e:
            (m.path / "params/embed.weight/param.npy").read_bytes()
        assert e.value.errno == errno.EIO
        assert "embed.weight" in m.log_text()
        # What rank 0 saved whole is still served.
        assert torch.load(m.path / "other/train_state.step", weights_only=False) == 1


def test_rank_local_metadata_disagreeing_on_a_shape_is_refused(dcp_fixtures, tmp_path):
    """A stale __1.metadata from another run (other shapes) next to __0's."""
    ck = copy(dcp_fixtures, "ranklocal_w2", tmp_path)
    other = copy(dcp_fixtures, "fsdp2_bf16_w2", tmp_path / "o")
    shutil.copy(other / ".metadata", ck / "__1.metadata")
    r = run([ckptfs_bin(), "info", str(ck), "--index", str(tmp_path / "ix")])
    assert r.returncode == 1
    assert "__1.metadata gives it as bfloat16 [13, 6], an earlier rank's metadata as float32 [13, 6]" in r.stderr, r.stderr


def test_safetensors_block_damage_is_named(dcp_fixtures, mounter, tmp_path):
    ck = copy(dcp_fixtures, "st_format_w2", tmp_path)
    f = ck / "__1_0.distcp"
    data = bytearray(f.read_bytes())
    # The block starts after rank 1's bytes items: its header length is the
    # first u64 followed by '{' from the end of the last bytes item.
    start = data.index(b'{"__metadata__"') - 8
    data[start + 8:start + 9] = b"["  # not a JSON object any more
    f.write_bytes(bytes(data))
    r = run([ckptfs_bin(), "info", str(ck), "--index", str(tmp_path / "ix")])
    assert r.returncode == 1
    assert "cannot read __1_0.distcp" in r.stderr or "cannot parse __1_0.distcp" in r.stderr, r.stderr
    with mounter(ck, index=tmp_path / "ix2") as m:
        with pytest.raises(OSError) as e:
            (m.path / "params/embed.weight/param.npy").read_bytes()
        assert e.value.errno == errno.EIO


@pytest.mark.parametrize("damage", ["truncated", "huge_header", "missing_file"])
def test_hf_storage_damage_is_named(damage, dcp_fixtures, mounter, tmp_path):
    ck = copy(dcp_fixtures, "hf_sharded_w2", tmp_path)
    f = ck / ("shard-00001-model-00001-of-00001.safetensors" if damage == "missing_file" else
              "shard-00002-model-00001-of-00001.safetensors")
    data = f.read_bytes()
    if damage == "truncated":
        f.write_bytes(data[: len(data) - 100])
        want = "lie outside the"
    elif damage == "huge_header":
        f.write_bytes((1 << 62).to_bytes(8, "little") + data[8:])
        want = "more than the format's limit"
    else:
        f.unlink()  # rank 0's shard: rank 1's alone would look like smaller tensors
        want = "shard-00001-model-00001-of-00001.safetensors is missing (rank 0's shard 1 of 1)"
    r = run([ckptfs_bin(), "info", str(ck), "--index", str(tmp_path / "ix")])
    assert r.returncode == 1 and want in r.stderr, r.stderr
    assert f.name in r.stderr, r.stderr
    with mounter(ck, index=tmp_path / "ix2") as m:
        with pytest.raises(OSError) as e:
            (m.path / "params/embed.weight/param.npy").read_bytes()
        assert e.value.errno == errno.EIO


def test_index_json_naming_a_missing_file_refuses_its_tensors(dcp_fixtures, tmp_path):
    ck = copy(dcp_fixtures, "hf_storage_w2", tmp_path)
    shutil.rmtree(ck / "sharded")
    idx = json.loads((ck / "model.safetensors.index.json").read_text())
    idx["weight_map"]["extra.weight"] = "model-00002-of-00002.safetensors"
    (ck / "model.safetensors.index.json").write_text(json.dumps(idx))
    r = run([ckptfs_bin(), "info", str(ck), "--index", str(tmp_path / "ix")])
    assert r.returncode == 1
    assert "model-00002-of-00002.safetensors" in r.stderr and "extra.weight" in r.stderr, r.stderr
    idx["weight_map"]["evil"] = "../outside.safetensors"
    (ck / "model.safetensors.index.json").write_text(json.dumps(idx))
    r = run([ckptfs_bin(), "info", str(ck), "--index", str(tmp_path / "ix3")])
    assert r.returncode == 1 and "is not a .safetensors file in the directory" in r.stderr, r.stderr


def test_torch_save_damage_is_named(dcp_fixtures, tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    data = (dcp_fixtures / "torch_save" / "model.pt").read_bytes()
    (ck / "model.pt").write_bytes(data[: len(data) // 2])
    r = run([ckptfs_bin(), "info", str(ck), "--index", str(tmp_path / "ix")])
    assert r.returncode == 1 and "cannot parse model.pt" in r.stderr, r.stderr
    # The same tensor path in two archives is refused, naming both.
    (ck / "model.pt").write_bytes(data)
    (ck / "copy.pt").write_bytes(data)
    r = run([ckptfs_bin(), "info", str(ck), "--index", str(tmp_path / "ix2")])
    assert r.returncode == 1 and "is in two archives (copy.pt and model.pt)" in r.stderr, r.stderr
    # consolidated.0X.pth shards of a model that is not Meta's Llama: each weight
    # refused with the reason, not merged along a guessed dimension.
    for f in ("model.pt", "copy.pt"):
        os.unlink(ck / f)
    for i in range(2):
        (ck / f"consolidated.0{i}.pth").write_bytes(data)
    r = run([ckptfs_bin(), "verify", str(ck), "--index", str(tmp_path / "ix3")])
    assert r.returncode != 0
    assert "'model.embed.weight': its split dimension across the 2 model-parallel shards is unknown" in r.stdout, \
        r.stdout
    # Only Trainer bookkeeping: not a checkpoint.
    shutil.rmtree(ck)
    ck.mkdir()
    (ck / "rng_state_0.pth").write_bytes(data)
    r = run([ckptfs_bin(), "info", str(ck), "--index", str(tmp_path / "ix4")])
    assert r.returncode == 1 and "cannot detect a checkpoint" in r.stderr, r.stderr


# ---------------------------------------------------------------- verl

VERL = ROOT / "tests" / "data" / "verl_fsdp2"  # make_verl.sh: verl 0.9.1's own FSDPCheckpointManager
VERL_HSDP = ROOT / "tests" / "data" / "verl_hsdp"  # the same over verl's ("ddp", "fsdp") mesh, 2 x 2 ranks
VERL_FSDP1 = ROOT / "tests" / "data" / "verl_fsdp1"  # and under FSDP1 (use_orig_params=False)


@pytest.mark.parametrize("data,world", [(VERL, 2), (VERL_HSDP, 4)], ids=["fsdp2", "hsdp"])
def test_verl_fsdp2_checkpoint_merges_and_exports(data, world, mounter, tmp_path):
    """Each rank's model_world_size_W_rank_R.pt holds DTensor shards (HSDP:
    Replicate over "ddp", Shard(0) over "fsdp", placed by the rank's mesh
    coordinate, replicas read once): params/ equals the full state the run
    gathered, in bf16 exactly what verl's own model merger wrote, optimizer ids
    land under their parameters, and hf/ (config and tokenizer from verl's
    huggingface/) loads in transformers."""
    from safetensors.torch import load_file

    full = torch.load(data / "full.pt", weights_only=False)
    merged = load_file(data / "merged" / "model.safetensors")
    src = data / "global_step_1" / "actor"
    r = run([ckptfs_bin(), "info", str(src), "--index", str(tmp_path / "ix")])
    assert r.returncode == 0, r.stderr
    assert f"verl FSDP checkpoint: {world} ranks" in r.stdout and "step        1" in r.stdout, r.stdout
    r = run([ckptfs_bin(), "verify", str(src), "--index", str(tmp_path / "ix")])
    assert r.returncode == 0, r.stdout + r.stderr
    with mounter(src, index=tmp_path / "ix") as m:
        for fqn, ref in full["model"].items():
            got = torch.from_numpy(npy(m, f"params/{fqn}/param.npy"))
            assert torch.equal(got, ref), fqn
            assert torch.equal(got.bfloat16(), merged[fqn]), fqn
            for state, sref in full["optimizer"]["state"][fqn].items():
                assert torch.equal(torch.from_numpy(npy(m, f"params/{fqn}/{state}.npy")).reshape(sref.shape), sref), (fqn, state)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(m.path / "hf")
        sd = model.state_dict()
        for fqn, ref in full["model"].items():
            assert torch.equal(sd[fqn], ref), fqn


def test_verl_damage_is_named(mounter, tmp_path):
    ck = tmp_path / "actor"
    shutil.copytree(VERL / "global_step_1" / "actor", ck, ignore=shutil.ignore_patterns(".ckptfs"))
    os.unlink(ck / "model_world_size_2_rank_1.pt")
    r = run([ckptfs_bin(), "info", str(ck), "--index", str(tmp_path / "ix")])
    assert r.returncode == 1
    assert "'model.embed_tokens.weight' in " in r.stderr and "elements are in no chunk" in r.stderr, r.stderr
    r = run([ckptfs_bin(), "verify", str(ck), "--json", "--index", str(tmp_path / "ix3")])
    msgs = [f["message"] for f in json.loads(r.stdout)["findings"]]
    assert "model_world_size_2_rank_1.pt is missing: rank 1's shards are unknown" in msgs, msgs
    with mounter(ck, index=tmp_path / "ix") as m:
        with pytest.raises(OSError) as e:
            (m.path / "params/model.embed_tokens.weight/param.npy").read_bytes()
        assert e.value.errno == errno.EIO
    # Rank 0's file copied over rank 1's: its DeviceMesh names rank 0, so it is
    # refused rather than placed as rank 1's rows.
    shutil.copy(VERL / "global_step_1" / "actor" / "model_world_size_2_rank_0.pt", ck / "model_world_size_2_rank_1.pt")
    r = run([ckptfs_bin(), "verify", str(ck), "--json", "--index", str(tmp_path / "ix4")])
    assert r.returncode != 0
    assert "is rank 0's shard (its DeviceMesh says so), not rank 1's" in r.stdout, r.stdout
    # One rank's file on its own is not a checkpoint of whole tensors.
    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(VERL / "global_step_1" / "actor" / "model_world_size_2_rank_0.pt", one / "model.pt")
    r = run([ckptfs_bin(), "info", str(one), "--index", str(tmp_path / "ix2")])
    assert r.returncode == 1 and "is a DTensor, one rank's shard" in r.stderr, r.stderr


def test_verl_hsdp_replicas_cover_a_missing_rank_and_a_lost_shard_is_named(mounter, tmp_path):
    """HSDP keeps every shard on each "ddp" replica: without rank 2's files
    (coordinate (1, 0)), rank 0's copy serves its rows and the absence is still
    a finding; without ranks 1 and 3 (the whole "fsdp" shard 1), the rows are
    holes: EIO."""
    full = torch.load(VERL_HSDP / "full.pt", weights_only=False)
    ck = tmp_path / "actor"
    shutil.copytree(VERL_HSDP / "global_step_1" / "actor", ck, ignore=shutil.ignore_patterns(".ckptfs"))
    for kind in ("model", "optim"):
        os.unlink(ck / f"{kind}_world_size_4_rank_2.pt")
    r = run([ckptfs_bin(), "verify", str(ck), "--json", "--index", str(tmp_path / "ix")])
    msgs = [f["message"] for f in json.loads(r.stdout)["findings"]]
    assert "model_world_size_4_rank_2.pt is missing: rank 2's shards are unknown" in msgs, msgs
    with mounter(ck, index=tmp_path / "ix") as m:
        for fqn, ref in full["model"].items():
            assert torch.equal(torch.from_numpy(npy(m, f"params/{fqn}/param.npy")), ref), fqn
    for rank in (1, 3):
        os.unlink(ck / f"model_world_size_4_rank_{rank}.pt")
    with mounter(ck, index=tmp_path / "ix2") as m:
        with pytest.raises(OSError) as e:
            (m.path / "params/model.embed_tokens.weight/param.npy").read_bytes()
        assert e.value.errno == errno.EIO
        assert "model.embed_tokens.weight" in m.log_text()


def test_verl_fsdp1_params_merge_and_flat_optimizer_states_are_refused(mounter, tmp_path):
    """verl (and SkyRL) under FSDP1 save model.state_dict() under
    SHARDED_STATE_DICT (ShardedTensors: merged, equal to the full state; verl's
    own model merger cannot load these outside a process group, see
    merger_status.txt) and the raw optimizer.state_dict(): per rank, plain 1-D
    pieces of flat parameters with nothing placing them. Those are refused by
    name, never served as rank 0's part; the step counters are served."""
    assert "before loading ShardedTensor" in (VERL_FSDP1 / "merger_status.txt").read_text()
    full = torch.load(VERL_FSDP1 / "full.pt", weights_only=False)
    src = VERL_FSDP1 / "global_step_1" / "actor"
    r = run([ckptfs_bin(), "verify", str(src), "--json", "--index", str(tmp_path / "ix")])
    assert r.returncode != 0
    msgs = " ".join(f["message"] for f in json.loads(r.stdout)["findings"])
    assert "'optimizer.state.0.exp_avg': every rank's optimizer file holds its own plain tensor" in msgs, msgs
    with mounter(src, index=tmp_path / "ix") as m:
        for fqn, ref in full["model"].items():
            assert torch.equal(torch.from_numpy(npy(m, f"params/{fqn}/param.npy")), ref), fqn
        with pytest.raises(OSError) as e:
            (m.path / "other/optimizer.state.0.exp_avg.npy").read_bytes()
        assert e.value.errno == errno.EIO
        assert torch.equal(torch.from_numpy(npy(m, "other/optimizer.state.0.step.npy")), torch.tensor(1.0))


# ---------------------------------------------------------------- Meta consolidated.0X.pth

META = ROOT / "tests" / "data" / "meta_llama_mp2"  # make_meta_llama.sh: Meta's llama-models + fairscale


def test_meta_model_parallel_shards_merge_into_the_mp1_model(mounter, tmp_path):
    """consolidated.00.pth / .01.pth: each model-parallel rank's state dict of
    Meta's reference Llama (fairscale Column/RowParallelLinear,
    VocabParallelEmbedding). Mounted, every weight equals the same model built
    at MP=1 (fairscale inits the full master weight and keeps each rank's
    slice), whose logits are the MP=2 run's."""
    full = torch.load(META / "full.pt", weights_only=False)
    torch.testing.assert_close(full["logits_mp1"], full["logits_mp2"], rtol=1e-4, atol=1e-4)
    src = tmp_path / "mp2"
    shutil.copytree(META / "mp2", src)
    r = run([ckptfs_bin(), "verify", str(src), "--index", str(tmp_path / "ix")])
    assert r.returncode == 0, r.stdout + r.stderr
    with mounter(src, index=tmp_path / "ix") as m:
        info = json.loads((m.path / "checkpoint.json").read_text())
        assert info["family"] == "meta-consolidated" and "2 consolidated.NN.pth shards" in info["format"], info
        for key, ref in full["model"].items():
            got = torch.from_numpy(npy(m, f"params/{key}/param.npy"))
            assert torch.equal(got, ref), key
        assert len(full["model"]) == 21
        # hf/: config.json from Meta's params.json, wq/wk RoPE rows permuted to
        # Hugging Face's layout; transformers gives Meta's reference logits.
        from transformers import AutoModelForCausalLM

        assert (m.path / "hf" / "ERRORS").read_text() == ""
        cfg = json.loads((m.path / "hf" / "config.json").read_text())
        assert (cfg["intermediate_size"], cfg["num_key_value_heads"], cfg["rope_theta"]) == (112, 2, 500000.0), cfg
        model = AutoModelForCausalLM.from_pretrained(m.path / "hf")
        with torch.no_grad():
            logits = model(full["tokens"]).logits
        torch.testing.assert_close(logits, full["logits_mp1"], rtol=0, atol=5e-5)
        torch.testing.assert_close(logits, full["logits_mp2"], rtol=0, atol=5e-5)
    # A shard copied over another, a missing shard, or shards of two different
    # models, are named.
    shutil.copy(src / "consolidated.00.pth", src / "consolidated.01.pth")
    r = run([ckptfs_bin(), "info", str(src), "--index", str(tmp_path / "ix1")])
    assert r.returncode == 1 and "consolidated.01.pth holds the same 'tok_embeddings.weight' bytes as " \
        "consolidated.00.pth" in r.stderr, r.stderr
    os.unlink(src / "consolidated.01.pth")
    shutil.copy(META / "mp2" / "consolidated.01.pth", src / "consolidated.02.pth")
    r = run([ckptfs_bin(), "info", str(src), "--index", str(tmp_path / "ix2")])
    assert r.returncode == 1 and "consolidated.01.pth is missing" in r.stderr, r.stderr
    os.unlink(src / "consolidated.02.pth")
    shutil.copy(VERL / "global_step_1" / "actor" / "model_world_size_2_rank_0.pt", src / "consolidated.01.pth")
    r = run([ckptfs_bin(), "info", str(src), "--index", str(tmp_path / "ix3")])
    # (verl's Llama also has 21 tensors, under other names)
    assert r.returncode == 1 and "'tok_embeddings.weight': consolidated.01.pth does not hold it" in r.stderr, r.stderr

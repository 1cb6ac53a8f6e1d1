"""--family: a directory two families can claim (a Megatron torch_dist
iteration is a plain DCP with metadata.json beside it) read as the one asked
for, through the CLI, a mount (-o family=) and the Python package; the names
come from the core's family table (ckptfs.families(), the CLI's choices)."""
import json
import subprocess

import numpy as np
import pytest

from conftest import ROOT, ckptfs_bin, run

# Committed, written by megatron-core 0.15.0 (tests/data/megatron_versions/VERSIONS.txt).
SRC = ROOT / "tests" / "data" / "megatron_versions" / "mcore0.15.0-dist_tp2_pp2" / "iter_0000007"
# The family table's order (detection priority, then each reader's families).
FAMILIES = ["megatron-torch_dist", "megatron-zarr", "pytorch-dcp", "deepspeed", "megatron-legacy", "safetensors",
            "verl", "accelerate-fsdp", "torch-save", "meta-consolidated", "orbax"]


def info(index, *extra):
    r = run([ckptfs_bin(), "info", "--json", "--index", str(index), *extra, str(SRC)])
    assert r.returncode in (0, 1), r.stderr
    return json.loads(r.stdout), r


def test_detected_and_forced_family_from_the_cli(tmp_path):
    detected, _ = info(tmp_path / "a")
    assert detected["family"] == "megatron-torch_dist"
    forced, _ = info(tmp_path / "b", "--family", "pytorch-dcp")
    assert forced["family"] == "pytorch-dcp"
    # The same index asked for the other family is rebuilt, not reused.
    again, _ = info(tmp_path / "b", "--family", "megatron-torch_dist")
    assert again["family"] == "megatron-torch_dist"
    # Without --family a fresh index is used as it is.
    kept, _ = info(tmp_path / "b")
    assert kept["family"] == "megatron-torch_dist"


def test_a_family_whose_probe_does_not_match_is_refused_before_anything_is_written(tmp_path):
    r = run([ckptfs_bin(), "info", "--index", str(tmp_path / "ix"), "--family", "deepspeed", str(SRC)])
    assert r.returncode == 1
    assert f"--family deepspeed: {SRC} has no latest / mp_rank_XX_model_states.pt (DeepSpeed)" in r.stderr
    assert not (tmp_path / "ix").exists()


def test_the_cli_offers_the_tables_names(tmp_path):
    r = run([ckptfs_bin(), "info", "--family", "megatron", str(SRC)])
    assert r.returncode == 2
    assert "{" + ",".join(FAMILIES) + "}" in r.stderr, r.stderr
    assert "--family" in run([ckptfs_bin(), "mount", "--help"]).stdout


def test_forced_mount_serves_the_stacked_dcp_tensor_the_megatron_mount_splits(tmp_path, mounter):
    """-o family=pytorch-dcp shows Megatron's layer stacks as the DCP stores
    them; numpy reads each layer of the stack equal to the Megatron mount's
    per-layer file."""
    with mounter(SRC, name="dcp", index=tmp_path / "ix-dcp", extra=["-o", "family=pytorch-dcp"]) as d, \
            mounter(SRC, name="meg", index=tmp_path / "ix-meg") as m:
        assert json.loads((d.path / "checkpoint.json").read_text())["family"] == "pytorch-dcp"
        assert json.loads((m.path / "checkpoint.json").read_text())["family"] == "megatron-torch_dist"
        stack = np.load(d.path / "params" / "decoder.layers.self_attention.linear_qkv.weight" / "param.npy")
        assert stack.ndim == 3 and stack.shape[0] >= 2
        for layer in range(stack.shape[0]):
            one = np.load(m.path / "params" / f"decoder.layers.{layer}.self_attention.linear_qkv.weight" / "param.npy")
            np.testing.assert_array_equal(stack[layer], one)
        assert not (d.path / "topo" / "tp1-pp1" / "layout.json").read_text().count("megatron_native")
        assert "megatron_native" in json.loads((m.path / "topo" / "tp1-pp1" / "layout.json").read_text())


def test_python_package_takes_the_same_names(tmp_path):
    ckptfs = pytest.importorskip("ckptfs")
    assert list(ckptfs.families()) == FAMILIES
    ck = ckptfs.open(SRC, index=tmp_path / "ix", family="pytorch-dcp")
    assert ck.info()["family"] == "pytorch-dcp"
    stack = ck.read("decoder.layers.self_attention.linear_qkv.weight", dtype="float32")
    meg = ckptfs.open(SRC, index=tmp_path / "ix2")
    assert meg.info()["family"] == "megatron-torch_dist"
    np.testing.assert_array_equal(stack[1], meg.read("decoder.layers.1.self_attention.linear_qkv.weight", dtype="float32"))
    with pytest.raises(ValueError, match="expected one of megatron-torch_dist, megatron-zarr, pytorch-dcp"):
        ckptfs.open(SRC, index=tmp_path / "ix3", family="megatron")
    with pytest.raises(ckptfs.Error, match="--family verl"):
        ckptfs.open(SRC, index=tmp_path / "ix4", family="verl")


def test_info_names_the_family_in_its_table(tmp_path):
    out = subprocess.run([ckptfs_bin(), "info", "--index", str(tmp_path / "ix"), str(SRC)], capture_output=True,
                         text=True, timeout=300)
    assert "family      megatron-torch_dist" in out.stdout

"""`ckptfs verify` and .ckptfs/report.json on DCP checkpoints written by torch.

One fixture per incident (the torchtitan #474 pipeline collision, written by a
real 2-stage pipeline job through dcp.save), damaged copies of clean fixtures
(a missing rank file, a truncated shard, NaN/Inf in a saved tensor), and every
clean DCP fixture, which must produce no finding at all. The DeepSpeed and
Megatron incidents are tested next to their fixtures (test_deepspeed_mount.py,
test_megatron_mount.py).
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import run

torch = pytest.importorskip("torch")

CLEAN_DCP = ["single", "replicated_w2", "fsdp2_w3", "fsdp2_bf16_w2", "dtensor_dim0_w2", "dtensor_dim0_w4",
             "dtensor_dim1_w2", "dtensor_dim1_w4", "steps_a", "steps_b", "pp_w2"]


def verify(bin_path, src, *extra, index=None):
    args = [bin_path, "verify", str(src), "--json", *extra]
    if index:
        args += ["--index", str(index)]
    r = run(args)
    assert r.stdout, r.stderr
    return r.returncode, json.loads(r.stdout)


def copy_ckpt(src, dst):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".ckptfs"))
    return dst


def without_timing(report):
    report = json.loads(json.dumps(report))
    for k in ("seconds", "gb_per_s"):
        report["summary"].pop(k, None)
    return report


@pytest.mark.parametrize("scenario", CLEAN_DCP)
def test_clean_dcp_fixtures_have_no_finding(scenario, dcp_fixtures, bin_path):
    rc, rep = verify(bin_path, dcp_fixtures / scenario)
    assert rep["findings"] == [], rep["findings"]
    assert (rc, rep["verdict"], rep["exit_code"]) == (0, "clean", 0)
    assert rep["summary"]["tensors_read"] == len([t for t in rep["tensors"] if t["read"]]) > 0


def test_pipeline_stages_reusing_layer_names_are_flagged(dcp_fixtures, bin_path, tmp_path):
    """torchtitan #474: both stages saved layers.0/layers.1; DCP kept one copy of
    each, so layers 2 and 3 of the 4 in params.json are gone."""
    src = dcp_fixtures / "pp_collision_w2"
    rc, rep = verify(bin_path, src)
    assert rc == 3 and rep["verdict"] == "problems"
    [f] = rep["findings"]
    assert f["check"] == "name-collision" and f["severity"] == "error"
    assert f["detail"]["missing_layers"] == [2, 3]
    assert f["detail"]["configured_layers"] == 4 and f["detail"]["configured_from"] == "params.json:n_layers"
    assert "torchtitan #474" in f["message"]

    # The configured count can come from the command line instead.
    bare = copy_ckpt(src, tmp_path / "bare")
    (bare / "params.json").unlink()
    rc, rep = verify(bin_path, bare, "--num-layers", "4")
    assert rc == 3 and rep["findings"][0]["detail"]["missing_layers"] == [2, 3]
    # Without any configured count, layers 0..1 with no gap are a 2-layer model.
    rc, rep = verify(bin_path, bare)
    assert rc == 0 and rep["findings"] == []
    # The correctly named run of the same job is clean against the same config.
    rc, rep = verify(bin_path, dcp_fixtures / "pp_w2")
    assert rc == 0 and rep["summary"]["configured_layers"] == 4


def test_gap_in_layer_numbering_is_flagged_without_config(dcp_fixtures, bin_path, tmp_path):
    """Layers 0, 1, 3 saved (interleaved stages, one of them lost): a gap needs no config."""
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "gap"
    state = {f"layers.{i}.w": torch.full((2, 2), float(i + 1)) for i in (0, 1, 3)}
    dcp.save({"model": state}, checkpoint_id=str(out))
    rc, rep = verify(bin_path, out)
    assert rc == 3
    [f] = rep["findings"]
    assert f["check"] == "name-collision" and f["detail"]["missing_layers"] == [2]


def test_missing_rank_file_is_a_hole_with_coordinates(dcp_fixtures, bin_path, tmp_path):
    src = copy_ckpt(dcp_fixtures / "dtensor_dim0_w2", tmp_path / "ck")
    (src / "__1_0.distcp").unlink()
    rc, rep = verify(bin_path, src)
    assert rc == 3
    cov = [f for f in rep["findings"] if f["check"] == "coverage"]
    assert len(cov) == 1 and cov[0]["file"] == "__1_0.distcp"
    assert "__1_0.distcp is missing" in cov[0]["message"]
    holes = cov[0]["detail"]["holes"]
    assert holes and all(h["region"].startswith("[") for h in holes)
    assert cov[0]["detail"]["tensors_affected"] >= 1


def test_truncated_shard_is_unreadable_exit_1(dcp_fixtures, bin_path, tmp_path):
    src = copy_ckpt(dcp_fixtures / "fsdp2_w3", tmp_path / "ck")
    p = src / "__2_0.distcp"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    rc, rep = verify(bin_path, src)
    assert rc == 1 and rep["verdict"] == "unreadable"
    bad = [f for f in rep["findings"] if f["check"] == "unreadable"]
    assert bad and all("__2_0.distcp" in f["message"] for f in bad)


def test_not_a_checkpoint_exits_1(bin_path, tmp_path):
    (tmp_path / "x.txt").write_text("hello")
    r = run([bin_path, "verify", str(tmp_path)])
    assert r.returncode == 1 and "ckptfs:" in r.stderr


def test_deep_counts_nan_inf_and_norms_match_numpy(bin_path, tmp_path, mounter):
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "nan"
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 33, generator=g)
    w[3, 4] = float("nan")
    w[5, 6] = float("inf")
    w[7, 8] = float("-inf")
    b = torch.randn(1000, generator=g).to(torch.bfloat16)
    h = torch.randn(77, generator=g).half()
    dcp.save({"w": w, "b": b, "h": h, "i": torch.arange(5)}, checkpoint_id=str(out))

    rc, plain = verify(bin_path, out)
    assert rc == 0 and plain["findings"] == []  # NaN is only looked for with --deep
    rc, rep = verify(bin_path, out, "--deep")
    assert rc == 3
    [f] = rep["findings"]
    assert f["check"] == "numerics" and f["tensor"] == "w"
    assert f["detail"] == {"nan": 1, "inf": 2, "elements": 64 * 33}
    by_key = {t["key"]: t for t in rep["tensors"]}
    with mounter(out) as m:
        for key, ref in (("w", w), ("b", b), ("h", h)):
            arr = np.load(m.path / "params" / key / "param.npy").astype(np.float64)
            finite = arr[np.isfinite(arr)]
            assert by_key[key]["l2_norm"] == pytest.approx(float(np.sqrt((finite ** 2).sum())), rel=1e-9)
            assert by_key[key]["max_abs"] == pytest.approx(float(np.abs(finite).max()), rel=0)
            assert by_key[key]["nan"] == int(np.isnan(arr).sum())
            assert by_key[key]["inf"] == int(np.isinf(arr).sum())
        assert "nan" not in by_key["i"]  # integers have no NaN
    # Every byte once: the deep pass reads exactly what the plain pass reads.
    assert rep["summary"]["bytes_read"] == plain["summary"]["bytes_read"]
    # The table names the tensor and its counts.
    r = run([bin_path, "verify", str(out), "--deep"])
    assert r.returncode == 3 and "numerics" in r.stdout and "NAN" in r.stdout


def test_xxh3_in_report_equals_info_json(dcp_fixtures, bin_path, mounter, tmp_path):
    """The report's per-tensor hash is the one info.json serves (same bytes, same hash)."""
    src = dcp_fixtures / "fsdp2_w3"
    rc, rep = verify(bin_path, src)
    with mounter(src) as m:
        checked = 0
        for t in rep["tensors"]:
            if t["fqn"] and t["state"] and t["read"]:
                info = json.loads((m.path / "params" / t["fqn"] / "info.json").read_text())
                assert info["tensors"][t["state"]]["xxh3_64_raw"] == t["xxh3"]
                checked += 1
        assert checked >= 12


@pytest.mark.parametrize("scenario", ["pp_collision_w2", "fsdp2_w3"])
def test_mount_report_json_is_verify_json(scenario, dcp_fixtures, bin_path, mounter, tmp_path):
    src = dcp_fixtures / scenario
    rc, rep = verify(bin_path, src)
    with mounter(src) as m:
        assert ".ckptfs" in os.listdir(m.path)
        p = m.path / ".ckptfs" / "report.json"
        text = p.read_text()
        assert os.stat(p).st_size == len(text.encode())
        mounted = json.loads(text)
        assert "seconds" not in mounted["summary"]
        assert mounted == without_timing(rep)
        # Copying it with cp gives the same bytes.
        subprocess.run(["cp", str(p), str(tmp_path / "r.json")], check=True)
        assert (tmp_path / "r.json").read_text() == text


def test_stat_and_listing_never_run_the_checks(dcp_fixtures, mounter, tmp_path):
    """du, find and ls -laR stat every file: report.json shows size 0 and the
    data pass does not run (it would read every byte); the first read runs
    it, and its size is then the report's."""
    src = copy_ckpt(dcp_fixtures / "dtensor_dim0_w2", tmp_path / "ck")
    with mounter(src, index=tmp_path / "ix") as m:
        for cmd in (["du", "-sh", str(m.path)], ["find", str(m.path), "-size", "+0"], ["ls", "-laR", str(m.path)]):
            subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        # du is honest: the tree occupies no storage; its apparent size is what reads return.
        du = subprocess.run(["du", "-s", "--block-size=1", str(m.path)], capture_output=True, text=True, timeout=120)
        apparent = subprocess.run(["du", "-s", "--apparent-size", "--block-size=1", str(m.path)],
                                  capture_output=True, text=True, timeout=120)
        assert du.stdout.split()[0] == "0" and int(apparent.stdout.split()[0]) > 0, (du.stdout, apparent.stdout)
        p = m.path / ".ckptfs" / "report.json"
        assert p.stat().st_size == 0
        assert "verified" not in m.log_text(), m.log_text()[-2000:]
        report = json.loads(p.read_text())
        assert report["verdict"] == "clean" and "verified" in m.log_text()
        assert p.stat().st_size == len(p.read_bytes()) > 0

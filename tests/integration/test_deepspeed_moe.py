"""DeepSpeed MoE (native `deepspeed.moe.layer.MoE`) checkpoints through a real mount.

The real engine writes them on CPU (tests/fixtures/make_deepspeed_moe.py: two
MoE layers of 4 experts at expert-parallel 2, DP 2 and 4, ZeRO-1/2, fp32 and
bf16). Each expert-parallel rank keeps its experts under local names
(deepspeed_experts.0, .1) in param_shapes and its optimizer partitions, over
an expert-data-parallel group of DP/EP ranks; the expert files name them
globally. params/ must serve every global expert's fp32 master, Adam states
and model copy exactly as the engine holds them (DeepSpeed's own
safe_get_full_* on the rank that owns the expert).
"""
import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES, ROOT, ckptfs_bin, fixture_lock, run, run_producer

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

PRODUCER = FIXTURES / "make_deepspeed_moe.py"
ENV = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
SCENARIOS = {
    "dp2_ep2_s2_fp32": ["--dp", "2", "--ep", "2", "--stage", "2"],
    "dp4_ep2_s1_bf16": ["--dp", "4", "--ep", "2", "--stage", "1", "--dtype", "bf16"],
    "dp2_ep1_s2_fp32": ["--dp", "2", "--ep", "1", "--stage", "2"],
}


@pytest.fixture(scope="session")
def moe_root(tmp_path_factory):
    base = os.environ.get("CKPTFS_FIXTURE_CACHE")
    return Path(base) / "deepspeed_moe" if base else tmp_path_factory.mktemp("deepspeed_moe")


@pytest.fixture(scope="session", params=sorted(SCENARIOS))
def scenario(request, moe_root):
    ck = moe_root / request.param
    with fixture_lock(ck):
        if not (ck / "reference_rank0.pt").exists():
            run_producer([sys.executable, str(PRODUCER), str(ck)] + SCENARIOS[request.param], ck, ENV)
    return request.param, ck


def engine_states(ck):
    """{global name: (states, model copy)} from every rank's references: an
    expert under its global id (each rank says which it holds)."""
    out = {}
    for f in sorted(ck.glob("reference_rank*.pt")):
        ref = torch.load(f, weights_only=False)
        ids = ref.pop("__experts__", {})
        mod = torch.load(ck / f.name.replace("reference_rank", "reference_module_rank"), weights_only=False)
        for name, states in ref.items():
            if name.startswith("__"):
                continue
            g = re.sub(r"deepspeed_experts\.\d+\.", f"deepspeed_experts.{ids[name]}.", name) if name in ids else name
            if g in out:  # the same tensor seen from another rank: it must agree
                assert all(torch.equal(out[g][0][k], states[k]) for k in states), g
            out[g] = (states, mod[name])
    return out


def test_every_expert_is_served_under_its_global_name(scenario, mounter):
    name, ck = scenario
    want = engine_states(ck)
    experts = {n for n in want if ".deepspeed_experts." in n}
    assert len(experts) == 2 * 4 * 4  # 2 MoE layers x 4 experts x (fc1, fc2) x (weight, bias)
    ep = int(SCENARIOS[name][SCENARIOS[name].index("--ep") + 1])
    with mounter(ck) as m:
        cj = json.loads((m.path / "checkpoint.json").read_text())
        assert cj["broken"] == [], cj["broken"][:3]
        assert any("MoE expert parameters" in p for p in cj["problems"]) == (ep > 1), cj["problems"]
        served = {p.name for p in (m.path / "params").iterdir()}
        assert served == set(want), sorted(served ^ set(want))[:10]
        for g, (states, module) in want.items():
            d = m.path / "params" / g
            for state, v in states.items():
                assert np.array_equal(np.load(d / f"{state}.npy"), v.float().numpy()), (g, state)
            assert (d / "param.raw").read_bytes() == module.contiguous().view(torch.uint8).numpy().tobytes(), g
        # At EP > 1 universal/ holds the dense parameters and no expert (see checkpoint.json).
        zero = {p.name for p in (m.path / "universal" / "zero").iterdir()} - {"optimizer_state.pt"}
        assert zero == (set(want) - experts if ep > 1 else set(want))


# Written by DeepSpeed 0.15.4 under Debian's CPython 3.11.2 (tests/fixtures/make_ds_py3112.sh): its MoE saves
# carry no param_shapes in mp_rank_00_model_states.pt and add expp_rank_<r>_mp_rank_00_optim_states.pt
# ({'optimizer': None} under ZeRO).
DS015_MOE = ROOT / "tests" / "data" / "ds_py3112" / "moe_z2_bf16_dp2_ep2"


def test_deepspeed_015_moe_serves_every_master_and_moment(mounter, tmp_path):
    want = engine_states(DS015_MOE)
    assert len([n for n in want if ".deepspeed_experts." in n]) == 2 * 4 * 4
    with mounter(DS015_MOE, index=tmp_path / "ix") as m:
        cj = json.loads((m.path / "checkpoint.json").read_text())
        assert cj["broken"] == [], cj["broken"][:3]
        assert not any("expp_rank" in p for p in cj["problems"]), cj["problems"]
        assert any("records no param_shapes" in p and "rebuilt from the optimizer files" in p
                   for p in cj["problems"]), cj["problems"]
        assert {p.name for p in (m.path / "params").iterdir()} == set(want)
        n = 0
        for g, (states, module) in want.items():
            d = m.path / "params" / g
            for state, v in states.items():
                assert np.array_equal(np.load(d / f"{state}.npy"), v.float().numpy()), (g, state)
                n += 1
            assert (d / "param.raw").read_bytes() == module.contiguous().view(torch.uint8).numpy().tobytes(), g
        assert n == 3 * len(want)  # every dense and expert fp32 master, exp_avg and exp_avg_sq
    r = run([ckptfs_bin(), "verify", "--index", str(tmp_path / "ix"), str(DS015_MOE), "--json"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert json.loads(r.stdout)["findings"] == []


def test_verify_finds_nothing(scenario, bin_path):
    name, ck = scenario
    r = run([bin_path, "verify", str(ck), "--json"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert json.loads(r.stdout)["findings"] == []


def test_ep1_universal_equals_ds_to_universal(moe_root, mounter):
    """At EP=1 ds_to_universal.py converts MoE (one directory per expert); at
    EP=2 it fails (it concatenates different experts that share a local name)."""
    from test_deepspeed_mount import ds_to_universal, tree, universal_diffs
    ck = moe_root / "dp2_ep1_s2_fp32"
    if not (ck / "reference_rank0.pt").exists():
        run_producer([sys.executable, str(PRODUCER), str(ck)] + SCENARIOS["dp2_ep1_s2_fp32"], ck, ENV)
    ucp = moe_root / "dp2_ep1_s2_fp32.ucp" / "universal"
    if not (ucp / "zero" / "optimizer_state.pt").exists():
        shutil.rmtree(ucp.parent, ignore_errors=True)
        tag = (ck / "latest").read_text().strip()
        r = subprocess.run([sys.executable, str(ds_to_universal()), "--input_folder", str(ck / tag), "--output_folder",
                            str(ucp)], env=ENV, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    with mounter(ck) as m:
        mine = m.path / "universal"
        assert tree(mine) == tree(ucp)
        diffs = universal_diffs(ucp, mine)
        assert not diffs, diffs[:10]


def test_missing_expert_file(moe_root, tmp_path, mounter):
    """A lost expert file: that expert's model copy is EIO naming the file
    pattern; its optimizer states and every other expert are served."""
    src = moe_root / "dp2_ep2_s2_fp32"
    if not (src / "reference_rank0.pt").exists():
        run_producer([sys.executable, str(PRODUCER), str(src)] + SCENARIOS["dp2_ep2_s2_fp32"], src, ENV)
    ck = tmp_path / "damaged"
    shutil.copytree(src, ck, ignore=shutil.ignore_patterns(".ckptfs"))
    tag = ck / (ck / "latest").read_text().strip()
    (tag / "layer_1_expert_2_mp_rank_00_model_states.pt").unlink()
    lost = "moe.1.deepspeed_moe.experts.deepspeed_experts.2.fc1.weight"
    with mounter(ck) as m:
        cj = json.loads((m.path / "checkpoint.json").read_text())
        broken = {b["key"] for b in cj["broken"]}
        assert lost in broken and all(".deepspeed_experts.2." in b for b in broken), broken
        with pytest.raises(OSError) as e:
            (m.path / "params" / lost / "param.npy").read_bytes()
        assert e.value.errno == errno.EIO
        assert "expert_2" in m.log_text()
        assert np.load(m.path / "params" / lost / "fp32.npy").shape == (6, 8)
        assert np.load(m.path / "params" / lost.replace("experts.2.", "experts.3.") / "param.npy").shape == (6, 8)

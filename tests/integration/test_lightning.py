"""PyTorch Lightning Trainer checkpoints (tests/fixtures/make_lightning.py: the
real Trainer, ModelParallelStrategy / FSDP2 on 2 gloo ranks, a checkpoint
after every step): the model under `state_dict.` and AdamW's state under
`optimizer_0.state.<fqn>.<state>` land under params/, the step comes from
Lightning's meta.pt, and the Trainer's checkpoints/ folder mounts its latest
checkpoint and names the others. The mount's dcp/ and accelerate/ resume it
under plain torch, Accelerate and Lightning Fabric at other world sizes."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES, fixture_lock, run_producer

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

STEPS = 3


@pytest.fixture(scope="session")
def lightning_run(tmp_path_factory):
    base = os.environ.get("CKPTFS_FIXTURE_CACHE")
    out = Path(base) / "lightning" if base else tmp_path_factory.mktemp("lightning")
    with fixture_lock(out):
        if not (out / "reference.pt").exists():
            run_producer([sys.executable, str(FIXTURES / "make_lightning.py"), str(out), "--steps", str(STEPS)], out,
                         dict(os.environ, PYTHONWARNINGS="ignore"))
    return out


def check_against_reference(mnt, ref):
    params = mnt / "params"
    assert {p.name for p in params.iterdir()} == set(ref["model"])
    for fqn, w in ref["model"].items():
        np.testing.assert_array_equal(np.load(params / fqn / "param.npy"), w.numpy(), err_msg=fqn)
        for state in ("exp_avg", "exp_avg_sq", "step"):
            want = ref["optim"][fqn][state]
            np.testing.assert_array_equal(np.load(params / fqn / f"{state}.npy"), want.numpy(), err_msg=(fqn, state))


def check_restored(got, ref):
    """A resume worker's output (weights, Adam states, param groups) against the
    Trainer's: the source's lr and weight decay, not the worker's own."""
    assert got["groups"][0]["lr"] == 1e-2 and got["groups"][0]["weight_decay"] == 0.1
    assert set(got["model"]) == set(ref["model"])
    for fqn, w in ref["model"].items():
        assert torch.equal(got["model"][fqn], w), fqn
        for state in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got["optim"][fqn][state], ref["optim"][fqn][state]), (fqn, state)


def test_trainer_checkpoint_states_under_params_and_step_from_meta(lightning_run, mounter, tmp_path):
    ref = torch.load(lightning_run / "reference.pt", weights_only=False)
    ck = lightning_run / "checkpoints" / f"epoch=0-step={STEPS}.ckpt"
    with mounter(ck, index=tmp_path / "ix") as m:
        cj = json.loads((m.path / "checkpoint.json").read_text())
        assert cj["step"] == ref["global_step"] == STEPS
        assert not any(p.name.startswith("optimizer_0.state.") for p in (m.path / "other").iterdir())
        check_against_reference(m.path, ref)
        meta = torch.load(m.path / "other" / "meta.pt", weights_only=False)  # Lightning's own, verbatim
        assert meta["global_step"] == STEPS and "loops" in meta


def test_trainer_checkpoints_folder_mounts_the_latest(lightning_run, mounter, tmp_path):
    ref = torch.load(lightning_run / "reference.pt", weights_only=False)
    with mounter(lightning_run / "checkpoints", index=tmp_path / "ix") as m:
        cj = json.loads((m.path / "checkpoint.json").read_text())
        assert cj["step"] == STEPS
        note = [p for p in cj["problems"] if "Lightning checkpoints" in p]
        assert len(note) == 1 and f"epoch=0-step={STEPS}.ckpt;" in note[0], cj["problems"]
        assert "epoch=0-step=1.ckpt" in note[0] and "epoch=0-step=2.ckpt" in note[0]
        check_against_reference(m.path, ref)
        # dcp/ hands the same state to torch's own DCP reader.
        from torch.distributed.checkpoint import FileSystemReader
        md = FileSystemReader(str(m.path / "dcp")).read_metadata()
        assert {f"optim.state.{fqn}.exp_avg" for fqn in ref["model"]} <= set(md.state_dict_metadata)


def test_a_plain_torch_loop_resumes_from_dcp_view(lightning_run, mounter, tmp_path):
    """The resume a framework does with torch's own API, unmodified: get_state_dict
    of a fresh model and AdamW, dcp.load from the mount's dcp/ with the default
    (strict) planner, set_state_dict. Weights, Adam moments, step counts and the
    param groups' hyperparameters all come back as the Trainer left them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    sys.path.insert(0, str(FIXTURES))
    from make_lightning import Net
    ref = torch.load(lightning_run / "reference.pt", weights_only=False)
    model = Net()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, foreach=False)
    msd, osd = get_state_dict(model, optim)
    sd = {"model": msd, "optim": osd}
    with mounter(lightning_run / "checkpoints", index=tmp_path / "ix") as m:
        dcp.load(sd, storage_reader=FileSystemReader(str(m.path / "dcp")), no_dist=True)
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert optim.param_groups[0]["lr"] == 1e-2 and optim.param_groups[0]["weight_decay"] == 0.1
    for fqn, p in model.named_parameters():
        assert torch.equal(p.detach(), ref["model"][fqn]), fqn
        for state in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optim.state[p][state], ref["optim"][fqn][state]), (fqn, state)


@pytest.mark.parametrize("world", [1, 3])
def test_accelerate_resumes_from_accelerate_view(world, lightning_run, mounter, tmp_path):
    """Accelerate's own resume (load_fsdp_model + load_fsdp_optimizer, what
    Accelerator.load_state and the HF Trainer call for FSDP SHARDED_STATE_DICT)
    pointed at the mount's accelerate/: a Lightning Trainer's FSDP2 run (2 ranks)
    continues under Accelerate's FSDP2 on 1 and on 3 ranks with its weights,
    Adam moments, steps and hyperparameters."""
    ref = torch.load(lightning_run / "reference.pt", weights_only=False)
    out = tmp_path / "restored.pt"
    with mounter(lightning_run / "checkpoints", index=tmp_path / "ix") as m:
        acc = m.path / "accelerate"
        assert sorted(p.name for p in acc.iterdir()) == ["README.txt", "optimizer_0", "pytorch_model_fsdp_0"]
        for sub in ("optimizer_0", "pytorch_model_fsdp_0"):
            assert sorted(p.name for p in (acc / sub).iterdir()) == sorted(p.name for p in (m.path / "dcp").iterdir())
            assert (acc / sub / ".metadata").read_bytes() == (m.path / "dcp" / ".metadata").read_bytes()
        r = subprocess.run([sys.executable, str(FIXTURES / "accelerate_resume_worker.py"), str(acc), str(out),
                            str(world)], capture_output=True, text=True, timeout=600,
                           cwd=str(FIXTURES), env=dict(os.environ, PYTHONWARNINGS="ignore"))
        assert r.returncode == 0, r.stderr[-4000:]
    got = torch.load(out, weights_only=False)
    check_restored(got, ref)


@pytest.mark.parametrize("world", [1, 3])
def test_fabric_resumes_from_dcp_view(world, lightning_run, mounter, tmp_path):
    """Lightning Fabric's own load (ModelParallelStrategy, FSDP2) pointed at the
    mount's dcp/: fabric.load takes a directory for a sharded checkpoint only
    with Fabric's meta.pt beside the DCP files, reads `model.` and `optimizer.`
    keys with torch's reader (strict), and returns what meta.pt holds. A
    Trainer's FSDP2 run (2 ranks) continues under Fabric on 1 and on 3 ranks
    with its weights, Adam moments, steps and hyperparameters."""
    ref = torch.load(lightning_run / "reference.pt", weights_only=False)
    out = tmp_path / "restored.pt"
    with mounter(lightning_run / "checkpoints", index=tmp_path / "ix") as m:
        assert torch.load(m.path / "dcp" / "meta.pt", weights_only=True) == {}
        assert "fabric.load" in (m.path / "dcp" / "README.txt").read_text()
        r = subprocess.run([sys.executable, str(FIXTURES / "fabric_resume_worker.py"), str(m.path / "dcp"), str(out),
                            str(world)], capture_output=True, text=True, timeout=600,
                           cwd=str(FIXTURES), env=dict(os.environ, PYTHONWARNINGS="ignore"))
        assert r.returncode == 0, r.stderr[-4000:]
    got = torch.load(out, weights_only=False)
    assert got["remainder"] == {}
    check_restored(got, ref)

"""DeepSpeed PipelineEngine (BLOOM / Megatron-DeepSpeed style) checkpoints and
DeepSpeed checkpoints written by an older DeepSpeed under Debian's Python 3.11.2.

Pipeline checkpoints are written by the real engine (tests/fixtures/
make_deepspeed_pipe.py: PipelineModule with a tied embedding, layer_XX-model_TT
files, mp_rank = pp*TP + tp, TP-drifted layer norms under
parameter_to_average_patterns, a fused QKV under parameter_with_sub_params).
Every universal/ file is compared with what this DeepSpeed's ds_to_universal.py
writes; params/ with the engine's own full states merged over TP here
(averaged norms as torch's sum(slices) / len(slices)); a DeepSpeed engine at
another TP loads the mounted universal/.

The tests/data/ds_py3112 checkpoints come from DeepSpeed 0.15.4 under CPython
3.11.2 (enum members pickled as getattr(ZeroStageEnum, 'name')); CI reads them
as committed, with that DeepSpeed's own universal conversions.
"""
import errno
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import FIXTURES, ROOT, fixture_lock, run, run_producer

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from test_deepspeed_mount import merge_reference, tree, universal_diffs  # noqa: E402

PRODUCER = FIXTURES / "make_deepspeed_pipe.py"
ENV = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
SCENARIOS = {
    "pp2_dp2_fp32": ["--pp", "2", "--tp", "1", "--dp", "2"],
    "pp2_tp2_dp1_bf16opt": ["--pp", "2", "--tp", "2", "--dp", "1", "--dtype", "bf16", "--bf16-optimizer"],
    "pp2_tp2_dp2_fp32_sub": ["--pp", "2", "--tp", "2", "--dp", "2", "--sub-params"],
}
PY3112 = ROOT / "tests" / "data" / "ds_py3112"


@pytest.fixture(scope="session", autouse=True)
def megatron_enums():
    """torch.load of these files needs megatron.enums (the producer registers it)."""
    sys.path.insert(0, str(FIXTURES))
    importlib.import_module("make_deepspeed_pipe")


@pytest.fixture(scope="session")
def pipe_root(tmp_path_factory):
    base = os.environ.get("CKPTFS_FIXTURE_CACHE")
    return Path(base) / "deepspeed_pipe" if base else tmp_path_factory.mktemp("deepspeed_pipe")


def produce(root, name):
    with fixture_lock(root / name):
        return _produce(root, name)


def _produce(root, name):
    ck = root / name
    if not list(ck.glob("reference_pp*_tp*.pt")):  # written last by the producer
        run_producer([sys.executable, str(PRODUCER), str(ck)] + SCENARIOS[name], ck, ENV)
    ucp = root / f"{name}.ucp" / "universal"
    if not (ucp / "zero" / "optimizer_state.pt").exists():
        shutil.rmtree(ucp.parent, ignore_errors=True)
        tag = (ck / "latest").read_text().strip()
        r = subprocess.run([sys.executable, str(PRODUCER), "--to-universal", str(ck / tag), str(ucp)], env=ENV,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return ck, ucp


@pytest.fixture(scope="session", params=sorted(SCENARIOS))
def scenario(request, pipe_root):
    ck, ucp = produce(pipe_root, request.param)
    return request.param, ck, ucp


def uc_info(ck):
    tag = (ck / "latest").read_text().strip()
    return torch.load(ck / tag / "mp_rank_00_model_states.pt", weights_only=False)["universal_checkpoint_info"]


def pipe_merge(name, slices, info):
    """TP slices -> the global tensor, independently of ckptfs and in
    ds_to_universal.py's precedence: replicated, averaged (Python's sum over
    n, in the slices' dtype), two sub-params, sub-params (equal widths, as
    universal_checkpoint_version < 0.4 means), row parallel, cat dim 0; then
    the vocabulary cut."""
    def match(key):
        return any(re.match(p, name) for p in info.get(key, []))

    subs = [s for s in info.get("parameter_with_sub_params", []) if any(re.match(p, name) for p in s["patterns"])]
    if len(slices) == 1:
        full = slices[0]
    elif match("tp_replicated_parameter_patterns"):
        full = slices[0]
    elif match("parameter_to_average_patterns"):
        full = sum(slices) / len(slices)
    elif match("parameter_with_2_sub_params_cat_dim_0"):
        halves = [s.chunk(2, 0) for s in slices]
        full = torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    elif subs:
        dim, sizes = subs[0]["partition_dim"], subs[0]["shape"][subs[0]["partition_dim"]]
        pieces, off = [], 0
        for size in sizes:
            w = size // len(slices)
            pieces += [s.narrow(dim, off, w) for s in slices]
            off += w
        full = torch.cat(pieces, dim)
    else:
        full = torch.cat(slices, 1 if match("parameter_with_row_parallelism_patterns") else 0)
    if match("vocabulary_parameter_patterns"):
        full = full[: info["original_vocab_size"]]
    return full


def stage_refs(ck, kind):
    """reference[_module]_pp<p>_tp<t>.pt -> per TP rank, {global name: value}
    (a name two stages hold, the tied embedding, from the first stage)."""
    per_tp = {}
    for f in sorted(ck.glob(f"reference{kind}_pp*_tp*.pt")):
        pp, tp = map(int, re.findall(r"\d+", f.stem.split("_pp")[1]))
        d = per_tp.setdefault(tp, {})
        for n, v in torch.load(f, weights_only=False).items():
            d.setdefault(n, v)
    return [per_tp[t] for t in sorted(per_tp)]


def test_universal_equals_ds_to_universal(scenario, mounter):
    name, ck, ucp = scenario
    with mounter(ck) as m:
        mine = m.path / "universal"
        assert (m.path / "latest_universal").read_text() == "universal"
        assert tree(mine) == tree(ucp)
        diffs = universal_diffs(ucp, mine)
        assert not diffs, diffs[:10]


def test_params_equal_engine_states(scenario, mounter):
    name, ck, _ = scenario
    info = uc_info(ck)
    tps = stage_refs(ck, "")
    module = stage_refs(ck, "_module")
    with mounter(ck) as m:
        cj = json.loads((m.path / "checkpoint.json").read_text())
        assert cj["broken"] == [], cj["broken"][:3]
        assert "PipelineEngine" in cj["format"], cj
        assert any("megatron.enums.PositionEmbeddingType" in p for p in cj["problems"]), cj["problems"]
        averaged = 0
        for pname in tps[0]:
            d = m.path / "params" / pname
            for state in ("fp32", "exp_avg", "exp_avg_sq"):
                want = pipe_merge(pname, [t[pname][state].float() for t in tps], info)
                got = np.load(d / f"{state}.npy")
                assert np.array_equal(got, want.numpy()), (pname, state)
            # The model's own copy (layer files), in its dtype: .raw exact, .npy widened.
            want = pipe_merge(pname, [t[pname] for t in module], info)
            raw = (d / "param.raw").read_bytes()
            assert raw == want.contiguous().view(torch.uint8).numpy().tobytes(), pname
            assert np.array_equal(np.load(d / "param.npy"), want.float().numpy()), pname
            if len(tps) > 1 and any(re.match(p, pname) for p in info.get("parameter_to_average_patterns", [])):
                averaged += 1
                entries = json.loads((d / "info.json").read_text())["tensors"]
                assert all(e["mean_of_copies"] == len(tps) for k, e in entries.items() if k != "step"), entries
        assert averaged == (16 if len(tps) > 1 else 0)


def test_verify_finds_nothing(scenario, bin_path):
    name, ck, _ = scenario
    r = run([bin_path, "verify", str(ck), "--json"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert json.loads(r.stdout)["findings"] == []


def test_deepspeed_loads_mounted_universal_at_other_tp(pipe_root, mounter, tmp_path):
    """BLOOM's case: a TP=2 PP=2 BF16_Optimizer checkpoint with averaged norms,
    loaded through the mount by a DeepSpeed engine at TP=1 PP=2."""
    name = "pp2_tp2_dp1_bf16opt"
    ck, _ = produce(pipe_root, name)
    args = SCENARIOS[name][:]
    args[args.index("--tp") + 1] = "1"
    dump = tmp_path / "loaded"
    with mounter(ck) as m:
        r = subprocess.run([sys.executable, str(PRODUCER)] + args + ["--load-universal", str(m.path), "--dump", str(dump)],
                           env=ENV, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        loaded = {}
        for f in sorted(tmp_path.glob("loaded.pp*_tp0")):
            for n, v in torch.load(f, weights_only=False).items():
                loaded.setdefault(n, v)
        assert loaded
        for pname, states in loaded.items():
            for state in ("fp32", "exp_avg", "exp_avg_sq"):
                want = torch.load(m.path / "universal" / "zero" / pname / f"{state}.pt", weights_only=False)["param"]
                got = states[state][: want.shape[0]] if want.dim() else states[state]  # vocabulary rows zero-padded
                assert torch.equal(got, want), (pname, state)


def test_missing_layer_file(pipe_root, tmp_path, mounter):
    """A lost layer file: that layer's model copy is EIO (named in the log and
    checkpoint.json), its optimizer states and every other layer are served."""
    ck, _ = produce(pipe_root, "pp2_dp2_fp32")
    dst = tmp_path / "damaged"
    shutil.copytree(ck, dst, ignore=shutil.ignore_patterns(".ckptfs"))
    tag = dst / (dst / "latest").read_text().strip()
    (tag / "layer_02-model_00-model_states.pt").unlink()
    with mounter(dst) as m:
        cj = json.loads((m.path / "checkpoint.json").read_text())
        broken = {b["key"] for b in cj["broken"]}
        assert "2.input_layernorm.weight" in broken and all(b.startswith("2.") for b in broken), broken
        with pytest.raises(OSError) as e:
            (m.path / "params" / "2.input_layernorm.weight" / "param.npy").read_bytes()
        assert e.value.errno == errno.EIO
        assert "layer_02-model_00-model_states.pt" in m.log_text()
        assert np.load(m.path / "params" / "2.input_layernorm.weight" / "fp32.npy").size == 8
        assert np.load(m.path / "params" / "1.input_layernorm.weight" / "param.npy").size == 8


# ---- DeepSpeed 0.15.4 under CPython 3.11.2 (committed) -----------------------

# make_deepspeed.py's scenarios (the MoE one, from make_deepspeed_moe.py with its
# own references, is tested in test_deepspeed_moe.py).
PY3112_SCENARIOS = sorted(p.name for p in PY3112.iterdir()
                          if p.is_dir() and not p.name.endswith(".ucp") and not p.name.startswith("moe_")) \
    if PY3112.is_dir() else []


def copy_of(name, tmp_path):
    """A writable copy (the mount writes .ckptfs/ next to the checkpoint)."""
    dst = tmp_path / name
    shutil.copytree(PY3112 / name, dst)
    return dst


@pytest.mark.parametrize("name", PY3112_SCENARIOS)
def test_py3112_optimizer_states_are_served(name, tmp_path, mounter):
    """Every optimizer file holds getattr(ZeroStageEnum, 'name'); every state is
    served and equals the engine's own full states."""
    ck = copy_of(name, tmp_path)
    tag = ck / (ck / "latest").read_text().strip()
    stage1 = [f for f in tag.glob("*optim_states.pt") if not f.name.startswith("bf16_") or "bf16opt" not in name]
    assert all(b"getattr" in f.read_bytes() for f in stage1)
    ref = merge_reference(ck)
    with mounter(ck) as m:
        cj = json.loads((m.path / "checkpoint.json").read_text())
        assert cj["broken"] == [], cj["broken"][:3]
        assert "0.15.4" in cj["format"], cj["format"]
        for pname, states in ref.items():
            for state, want in states.items():
                assert np.array_equal(np.load(m.path / "params" / pname / f"{state}.npy"), want.numpy()), (pname, state)


@pytest.mark.parametrize("name", [n for n in PY3112_SCENARIOS if (PY3112 / f"{n}.ucp").is_dir()])
def test_py3112_universal_equals_that_deepspeeds_conversion(name, tmp_path, mounter):
    """universal/ equals DeepSpeed 0.15.4's ds_to_universal.py output; ckptfs
    adds only what today's converter adds (fp32.pt of module entries without
    optimizer state: the frozen position embedding and the buffer)."""
    ck = copy_of(name, tmp_path)
    ucp = PY3112 / f"{name}.ucp" / "universal"
    with mounter(ck) as m:
        mine = m.path / "universal"
        extra = set(tree(mine)) - set(tree(ucp))
        assert set(tree(ucp)) <= set(tree(mine))
        assert extra == {"zero/language_model.embedding.position_embeddings.weight/fp32.pt",
                         "zero/language_model.rotary_inv_freq/fp32.pt"}, extra
        diffs = universal_diffs(ucp, mine)
        assert not diffs, diffs[:10]


def test_corrupt_args_pickle(pipe_root, tmp_path, mounter):
    """Garbage inside the args of stage 0's mp_rank_00 pickle: that file's
    param_shapes are lost, so stage 0's optimizer states are EIO naming the
    file; stage 1, the model copy of every layer and universal/'s stage-1
    files are served."""
    ck, _ = produce(pipe_root, "pp2_dp2_fp32")
    dst = tmp_path / "damaged"
    shutil.copytree(ck, dst, ignore=shutil.ignore_patterns(".ckptfs"))
    f = dst / (dst / "latest").read_text().strip() / "mp_rank_00_model_states.pt"
    data = bytearray(f.read_bytes())
    i = data.find(b"PositionEmbeddingType")
    assert i > 0
    data[i - 40:i + 30] = b"\xfe" * 70
    f.write_bytes(bytes(data))
    with mounter(dst) as m:
        cj = json.loads((m.path / "checkpoint.json").read_text())
        broken = {b["key"].split("/")[0] for b in cj["broken"]}
        assert broken and all(k.split(".")[0] in ("1", "2") for k in broken), broken
        assert all("mp_rank_00_model_states.pt" in b["error"] for b in cj["broken"])
        with pytest.raises(OSError) as e:
            (m.path / "params" / "1.input_layernorm.weight" / "fp32.npy").read_bytes()
        assert e.value.errno == errno.EIO
        assert "mp_rank_00_model_states.pt" in m.log_text()
        assert np.load(m.path / "params" / "1.input_layernorm.weight" / "param.npy").size == 8
        assert np.load(m.path / "params" / "3.input_layernorm.weight" / "fp32.npy").size == 8
        ref = stage_refs(ck, "")[0]
        got = torch.load(m.path / "universal" / "zero" / "3.input_layernorm.weight" / "fp32.pt", weights_only=False)
        assert torch.equal(got["param"], ref["3.input_layernorm.weight"]["fp32"])


def test_topo_source_layout_is_each_ranks_own_slice(pipe_root, mounter):
    """topo/tp2-pp2/ of a TP=2 PP=2 PipelineEngine run: rank (t, p)'s file holds
    exactly the weights that rank's layer files hold (stages from the pipeline
    spec index; the averaged norms are the mean on every rank, the tied
    embedding lives on stage 0)."""
    from safetensors.torch import load_file
    name = "pp2_tp2_dp1_bf16opt"
    ck, _ = produce(pipe_root, name)
    info = uc_info(ck)
    averaged = info.get("parameter_to_average_patterns", [])
    with mounter(ck) as m:
        for p in range(2):
            for t in range(2):
                got = load_file(m.path / "topo" / "tp2-pp2" / f"tp{t}-pp{p}.safetensors")
                mod = torch.load(ck / f"reference_module_pp{p}_tp{t}.pt", weights_only=False)
                checked = 0
                for n, v in mod.items():
                    if n.startswith("tied_modules.") or any(re.match(a, n) for a in averaged):
                        continue
                    assert torch.equal(got[n], v), (n, p, t)
                    checked += 1
                assert checked >= 16, checked
        assert not (m.path / "topo" / "ERRORS").read_text().strip(), (m.path / "topo" / "ERRORS").read_text()


def test_info_says_when_optimizer_files_are_unreadable(tmp_path, bin_path):
    """Truncated optimizer files are not 'no optimizer files': info says how
    many there are and that none could be read, and their states are EIO."""
    ck = copy_of("z2_fp32_dp2", tmp_path)
    for f in (ck / "global_step2").glob("*optim_states.pt"):
        f.write_bytes(f.read_bytes()[:1000])
    r = run([bin_path, "info", str(ck), "--index", str(tmp_path / "ix")])
    assert r.returncode == 1 and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in r.stderr  # broken tensors: exit 1
    assert "2 ZeRO optimizer files, none readable" in r.stdout, r.stdout[:500]
    r = run([bin_path, "cat", str(ck), "params/language_model.encoder.final_layernorm.weight/fp32.npy",
             "--index", str(tmp_path / "ix")])
    assert r.returncode != 0 and "_optim_states.pt" in r.stderr and "truncated" in r.stderr, r.stderr[-500:]

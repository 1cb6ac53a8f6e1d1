"""topo/ resharded views and hf/ through a real mount, read by real clients:
safetensors.safe_open / load_file, torch.load(mmap=True), numpy.memmap, a
hand-split TP=2 torch model (gloo, CPU) and megatron-core itself.

Every expected slice is cut here with torch from the full tensor in params/
(itself checked against the producers in the family tests), by split rules
written in this file from each framework's own conventions: Megatron's layer
types, DeepSpeed's universal_checkpoint_info read from the checkpoint with
re.match, torchtitan's Llama names."""
import json
import mmap
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from conftest import FIXTURES, run  # noqa: E402
from test_deepspeed_mount import produce  # noqa: E402
from test_megatron_mount import megatron_fixtures  # noqa: E402,F401  (a session fixture)

sys.path.insert(0, str(FIXTURES))
from ports import free_port  # noqa: E402

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "int64": torch.int64, "float64": torch.float64, "int32": torch.int32}
LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)(?:\.|$)")


def full_tensor(mnt, fqn, state, stored=False):
    """params/<fqn>/<state>; `stored`: with its vocabulary padding rows after
    it, as the checkpoint stores it (Megatron's padded vocabulary)."""
    info = json.loads((mnt / "params" / fqn / "info.json").read_text())["tensors"][state]
    raw = (mnt / "params" / fqn / f"{state}.raw").read_bytes()
    shape = info["shape"]
    if stored and "vocab_padding" in info:
        raw += (mnt / "params" / fqn / f"{state}.vocab_padding.raw").read_bytes()
        shape = info["vocab_padding"]["stored_shape"]
    return torch.frombuffer(bytearray(raw), dtype=TORCH_DTYPES[info["dtype"]]).reshape(shape) if raw else \
        torch.empty(shape, dtype=TORCH_DTYPES[info["dtype"]])


def all_states(mnt):
    """(fqn, state) of every parameter and optimizer state in params/."""
    out = []
    for d in sorted((mnt / "params").iterdir()):
        for f in sorted(d.glob("*.raw")):
            if not f.stem.endswith(".vocab_padding"):
                out.append((d.name, f.stem))
    return out


def key_of(fqn, state):
    return fqn if state == "param" else f"optimizer.state.{fqn}.{state}"


# --- split rules, one per family, written from the frameworks' conventions ---

def megatron_rule(fqn):
    if "layernorm" in fqn or ".layer_norm_" in fqn or "position_embeddings" in fqn or "norm." in fqn:
        return ("replicate",)
    if ".linear_proj." in fqn or ".linear_fc2." in fqn:
        return ("replicate",) if fqn.endswith(".bias") else ("dim", 1)
    if ".linear_fc1." in fqn:
        return ("sub2",)
    return ("dim", 0)


def torchtitan_rule(fqn):
    if any(f".{n}." in fqn for n in ("wq", "wk", "wv", "w1", "w3")):
        return ("dim", 0)
    if any(f".{n}." in fqn for n in ("wo", "w2")):
        return ("replicate",) if fqn.endswith(".bias") else ("dim", 1)
    if fqn in ("tok_embeddings.weight", "output.weight"):
        return ("dim", 0)
    return ("replicate",)


def deepspeed_rule_from(uci):
    def m(key, fqn):
        return any(re.match(p, fqn) for p in uci.get(key, []))

    def rule(fqn):
        if m("tp_replicated_parameter_patterns", fqn):
            return ("replicate",)
        if m("parameter_with_2_sub_params_cat_dim_0", fqn):
            return ("sub2",)
        return ("dim", 1 if m("parameter_with_row_parallelism_patterns", fqn) else 0, m("vocabulary_parameter_patterns", fqn))
    return rule


def cut(full, rule, tp, t):
    """What TP rank t of tp holds, as torch would cut it."""
    if tp == 1 or rule[0] == "replicate" or full.dim() == 0:
        return full
    if rule[0] == "sub2":
        w, v = full.chunk(2, 0)
        return torch.cat([w.chunk(tp, 0)[t], v.chunk(tp, 0)[t]], 0)
    dim = rule[1]
    if len(rule) > 2 and rule[2] and full.shape[0] % tp:  # vocabulary re-padded with zero rows (DeepSpeed UCP)
        rows = -(-full.shape[0] // tp) * tp
        full = torch.cat([full, full.new_zeros((rows - full.shape[0],) + tuple(full.shape[1:]))], 0)
    return full.chunk(tp, dim)[t]


def stage_of(fqn, num_layers, pp):
    m = LAYER.search(fqn)
    if m:
        return int(m.group(1)) // (num_layers // pp)
    return 0 if "embed" in fqn else pp - 1


def check_view(mnt, topo, rule_of, stored=True):
    """`stored` False: a padded vocabulary is placed from its true rows and
    re-padded (DeepSpeed universal); True: as stored (Megatron's padding)."""
    tp, pp = (int(x[2:]) for x in topo.split("-")[:2])
    view = mnt / "topo" / topo
    states = all_states(mnt)
    layers = {int(LAYER.search(f).group(1)) for f, _ in states if LAYER.search(f)}
    num_layers = max(layers) + 1 if layers else 0
    seen = {}
    layout = json.loads((view / "layout.json").read_text())
    assert layout["tp"] == tp and layout["pp"] == pp
    for p in range(pp):
        for t in range(tp):
            path = view / f"tp{t}-pp{p}.safetensors"
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata()
                assert meta["ckptfs_topology"] == topo and meta["tp_rank"] == str(t) and meta["pp_rank"] == str(p)
                for k in f.keys():
                    seen.setdefault(k, []).append((t, p))
                    fqn, state = (k, "param") if not k.startswith("optimizer.state.") else \
                        next((fq, st) for fq, st in states if key_of(fq, st) == k)
                    full = full_tensor(mnt, fqn, state, stored)
                    rule = rule_of(fqn) if state == "param" or full.shape == full_tensor(mnt, fqn, "param", stored).shape \
                        else ("replicate",)
                    want = cut(full, rule, tp, t)
                    got = f.get_tensor(k)
                    assert got.dtype == want.dtype and got.shape == want.shape, (k, got.shape, want.shape)
                    assert torch.equal(got, want), (topo, k, t, p)
                    assert stage_of(fqn, num_layers, pp) == p, (k, p)
                    # A slice through the lazy API is the same slice.
                    if got.dim() >= 1 and got.shape[0] > 1:
                        assert torch.equal(f.get_slice(k)[1:], want[1:])
    # Every parameter and state is on exactly the ranks of one stage, once per TP rank.
    assert sorted(seen) == sorted(key_of(f, s) for f, s in states)
    for k, where in seen.items():
        assert sorted(t for t, _ in where) == list(range(tp)) and len({p for _, p in where}) == 1, k
    return layout


@pytest.mark.parametrize("topo", ["tp1-pp1", "tp2-pp1", "tp4-pp1", "tp1-pp2", "tp2-pp2", "tp4-pp2"])
def test_megatron_rank_files_are_torch_slices(megatron_fixtures, mounter, topo):
    with mounter(megatron_fixtures / "legacy_tp2_pp2") as m:
        layout = check_view(m.path, topo, megatron_rule)
        assert layout["source_topology"] == "tp2-pp2"


@pytest.mark.parametrize("source,topo", [("dist_tp2_pp2_dp2", "tp4-pp1"), ("dist_dpreshard_tp2_pp2_dp2", "tp4-pp1"),
                                         ("dist_dpreshard_tp2_pp2_dp2", "tp1-pp4"), ("dist_dpzero_tp2_pp2_dp2", "tp4-pp2")])
def test_megatron_torch_dist_source(megatron_fixtures, mounter, source, topo):
    """torch_dist sources, the dp_reshardable one included: its distributed-optimizer
    states at a new TP / PP (Megatron itself refuses to reshard them)."""
    with mounter(megatron_fixtures / source) as m:
        check_view(m.path, topo, megatron_rule)
        if "dp" in source.split("_")[1]:  # distributed-optimizer sources
            names = set(safe_open(str(m.path / "topo" / topo / "tp0-pp0.safetensors"), framework="pt").keys())
            assert any(k.startswith("optimizer.state.") and k.endswith(".exp_avg_sq") for k in names), sorted(names)[:5]


@pytest.mark.parametrize("topo", ["tp1-pp1", "tp2-pp1", "tp4-pp1", "tp1-pp2", "tp2-pp2", "tp4-pp2"])
def test_dcp_torchtitan_names_rank_files(dcp_fixtures, mounter, topo):
    with mounter(dcp_fixtures / "pp_w2") as m:
        check_view(m.path, topo, torchtitan_rule)


def test_dcp_rules_file_and_pp_layers(dcp_fixtures, mounter, tmp_path):
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"rules": [{"match": r"^proj\.weight$", "split": "dim", "dim": 1},
                                           {"match": r"^out\.weight$", "split": "dim", "dim": 1},
                                           {"match": r"^embed\.", "split": "replicate"}]}))

    def rule(fqn):
        return {"proj.weight": ("dim", 1), "out.weight": ("dim", 1)}.get(fqn, ("replicate",))
    with mounter(dcp_fixtures / "dtensor_dim1_w2", extra=["--rules", str(rules)]) as m:
        check_view(m.path, "tp2-pp1", rule)
    # Uneven stages by --pp-layers: 4 layers as 1 + 3.
    with mounter(dcp_fixtures / "pp_w2", name="uneven", extra=["--pp-layers", "1,3"]) as m:
        lay = json.loads((m.path / "topo" / "tp1-pp2" / "layout.json").read_text())
        assert [s["layers"] for s in lay["stages"]] == [[0, 1], [1, 4]]
        with safe_open(str(m.path / "topo/tp1-pp2/tp0-pp1.safetensors"), framework="pt") as f:
            assert {int(LAYER.search(k).group(1)) for k in f.keys() if LAYER.search(k)} == {1, 2, 3}


@pytest.fixture(scope="module")
def ds_ckpt(tmp_path_factory):
    base = os.environ.get("CKPTFS_FIXTURE_CACHE")
    root = Path(base) / "deepspeed" if base else tmp_path_factory.mktemp("deepspeed")
    ck, _ = produce(root, "z2_bf16_tp2_dp2")
    return ck


@pytest.mark.parametrize("topo", ["tp1-pp1", "tp2-pp1", "tp1-pp2", "tp2-pp2"])
def test_deepspeed_rank_files_are_torch_slices(ds_ckpt, mounter, topo):
    tag = (ds_ckpt / "latest").read_text().strip()
    uci = torch.load(ds_ckpt / tag / "mp_rank_00_model_states.pt", weights_only=False)["universal_checkpoint_info"]
    with mounter(ds_ckpt) as m:
        assert sorted(os.listdir(m.path / "topo"))[:2] == ["ERRORS", "tp2-pp1-dp2"]  # the source layout
        check_view(m.path, topo, deepspeed_rule_from(uci), stored=False)


def test_deepspeed_tp4_does_not_divide_enoent_and_errors(ds_ckpt, mounter):
    with mounter(ds_ckpt) as m:
        with pytest.raises(FileNotFoundError):
            os.stat(m.path / "topo" / "tp4-pp1")
        errors = (m.path / "topo" / "ERRORS").read_text()
        assert "topo/tp4-pp1: " in errors and "dense_h_to_4h" in errors and "TP=4" in errors
        assert "does not divide" not in m.log_text() or "topo/tp4-pp1" in m.log_text()
        assert "tp4-pp1" not in os.listdir(m.path / "topo")
        assert not (m.path / "topo" / "tp02-pp1").exists()  # one spelling per view


def test_dp_partitions_are_the_flat_rank_tensors(ds_ckpt, mounter):
    with mounter(ds_ckpt) as m:
        view = m.path / "topo" / "tp2-pp1-dp2"
        for t in range(2):
            rank = load_file(str(view / f"tp{t}-pp0.safetensors"))
            parts = [load_file(str(view / f"tp{t}-pp0-dp{d}.safetensors")) for d in range(2)]
            lay = json.loads((view / "layout.json").read_text())
            names = [e["name"] for e in lay["ranks"][t]["tensors"]]
            for state in parts[0]:
                keys = [n for n in names if key_state(n) == state]
                flat = torch.cat([rank[k].reshape(-1).to(parts[0][state].dtype) for k in keys])
                got = torch.cat([p[state] for p in parts])
                assert got.numel() % 4 == 0 and torch.equal(got[:flat.numel()], flat), state
                assert not got[flat.numel():].any()


def key_state(name):
    return name.rsplit(".", 1)[1] if name.startswith("optimizer.state.") else "param"


def test_hf_load_file_matches_params(dcp_fixtures, megatron_fixtures, mounter):
    for src, extra in [(megatron_fixtures / "legacy_tp2_pp2", []), (dcp_fixtures / "pp_w2", ["--hf-shard-size", "2K"])]:
        with mounter(src, name=src.name, extra=extra) as m:
            hf = m.path / "hf"
            idx = json.loads((hf / "model.safetensors.index.json").read_text())
            files = sorted(set(idx["weight_map"].values()))
            assert files == sorted(p.name for p in hf.glob("model-*.safetensors"))
            n = len(files)
            assert all(re.fullmatch(rf"model-\d{{5}}-of-{n:05d}\.safetensors", f) for f in files)
            if extra:
                assert n > 1
            got, total = {}, 0
            for f in files:
                part = load_file(str(hf / f))
                assert all(idx["weight_map"][k] == f for k in part)
                got.update(part)
                total += sum(v.numel() * v.element_size() for v in part.values())
            params = [fq for fq, st in all_states(m.path) if st == "param"]
            assert sorted(got) == sorted(params) and idx["metadata"]["total_size"] == total
            for fq in params:
                assert torch.equal(got[fq], full_tensor(m.path, fq, "param")), fq


def test_mmap_reads_view_files(megatron_fixtures, mounter):
    with mounter(megatron_fixtures / "legacy_tp2_pp2") as m:
        f = m.path / "topo" / "tp4-pp1" / "tp1-pp0.safetensors"
        data = f.read_bytes()
        with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            assert mm[:] == data
        assert bytes(np.memmap(f, dtype=np.uint8, mode="r")) == data
        native = m.path / "topo/tp4-pp1/iter_0000007/mp_rank_01/model_optim_rng.pt"
        a = torch.load(native, mmap=True, weights_only=False)
        b = torch.load(native, weights_only=False)
        assert a["model"].keys() == b["model"].keys()
        for k, v in a["model"].items():
            assert (v is None and b["model"][k] is None) or torch.equal(v, b["model"][k])


def test_megatron_native_view_at_source_topology_equals_source(megatron_fixtures, mounter):
    src = megatron_fixtures / "legacy_tp2_pp2"
    with mounter(src) as m:
        assert "tp2-pp2" in os.listdir(m.path / "topo")
        assert (m.path / "topo/tp2-pp2/latest_checkpointed_iteration.txt").read_text() == "7"
        for t in range(2):
            for p in range(2):
                rel = f"iter_0000007/mp_rank_{t:02d}_{p:03d}/model_optim_rng.pt"
                mine = torch.load(m.path / "topo" / "tp2-pp2" / rel, weights_only=False)
                theirs = torch.load(src / rel, weights_only=False)
                assert mine["iteration"] == theirs["iteration"] and mine["checkpoint_version"] == 3.0
                assert mine["args"].tensor_model_parallel_size == 2 and mine["args"].hidden_size == theirs["args"].hidden_size
                assert list(mine["model"]) == [k for k in theirs["model"]], rel
                for k, v in theirs["model"].items():
                    assert (v is None and mine["model"][k] is None) or torch.equal(mine["model"][k], v), k


def spawn(script, world, *args):
    env = dict(os.environ, PYTHONPATH=f"{FIXTURES}:{Path(__file__).parent}")
    for attempt in range(3):
        r = subprocess.run([sys.executable, str(Path(__file__).parent / script), str(world), str(free_port())] +
                           [str(a) for a in args], capture_output=True, text=True, timeout=600, env=env)
        # A listener that took the port between choosing and binding it: choose again.
        if r.returncode == 0 or "EADDRINUSE" not in r.stderr:
            break
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]


@pytest.mark.parametrize("source", ["legacy_tp2_pp2", "dist_dpreshard_tp2_pp2_dp2"])
def test_megatron_core_loads_native_view_at_new_tp(megatron_fixtures, mounter, tmp_path, source):
    """GPTModel built at TP=1, 2 and 4 (gloo, CPU) loads topo/tp<T>-pp1's
    model_optim_rng.pt with strict=True, and all three give the same logits."""
    with mounter(megatron_fixtures / source) as m:
        for tp in (1, 2, 4):
            spawn("topo_megatron_load.py", tp, m.path / "topo" / f"tp{tp}-pp1", tmp_path / f"logits{tp}.pt")
    l1 = torch.load(tmp_path / "logits1.pt")
    for tp in (2, 4):
        assert torch.allclose(torch.load(tmp_path / f"logits{tp}.pt"), l1, atol=1e-5, rtol=1e-4), tp


def test_megatron_moe_native_view_at_source_topology_equals_source(megatron_fixtures, mounter):
    """topo/tp2-pp2-ep2 of an EP=2 legacy MoE checkpoint: the 8 rank archives
    (mp_rank_TT_PPP_EEE, expert indices local to each EP rank) hold exactly the
    tensors, names and order megatron-core wrote."""
    src = megatron_fixtures / "legacy_moe_tp2_pp2_ep2"
    with mounter(src) as m:
        assert "tp2-pp2-ep2" in os.listdir(m.path / "topo")
        layout = json.loads((m.path / "topo/tp2-pp2-ep2/layout.json").read_text())
        assert layout["ep"] == 2 and layout["num_experts"] == 4 and len(layout["ranks"]) == 8
        for t in range(2):
            for p in range(2):
                for e in range(2):
                    rel = f"iter_0000007/mp_rank_{t:02d}_{p:03d}_{e:03d}/model_optim_rng.pt"
                    mine = torch.load(m.path / "topo" / "tp2-pp2-ep2" / rel, weights_only=False)
                    theirs = torch.load(src / rel, weights_only=False)
                    assert mine["args"].expert_model_parallel_size == 2 and mine["args"].num_experts == 4
                    assert list(mine["model"]) == list(theirs["model"]), rel
                    for k, v in theirs["model"].items():
                        assert (v is None and mine["model"][k] is None) or torch.equal(mine["model"][k], v), k
        with safe_open(str(m.path / "topo/tp2-pp2-ep2/tp0-pp1-ep1.safetensors"), "pt") as f:
            experts = {k.split("local_experts.")[1].split(".")[0] for k in f.keys() if "local_experts." in k}
            assert experts == {"2", "3"} and f.metadata()["ep_rank"] == "1"  # global names in the rank files


@pytest.mark.parametrize("source", ["legacy_moe_tp2_pp2_ep2", "dist_moe_tp2_pp2_ep2"])
def test_megatron_core_loads_moe_view_at_new_tp_and_ep(megatron_fixtures, mounter, tmp_path, source):
    """An MoE GPTModel (4 experts, top-2) built at (TP, EP) = (1, 1), (2, 1),
    (1, 2) and (2, 2) loads topo/tp<T>-pp1-ep<E> with strict=True; all give the
    same logits."""
    layouts = [(1, 1), (2, 1), (1, 2), (2, 2)]
    with mounter(megatron_fixtures / source) as m:
        for tp, ep in layouts:
            spawn("topo_megatron_load.py", tp * ep, m.path / "topo" / f"tp{tp}-pp1-ep{ep}", tmp_path / f"l{tp}{ep}.pt", ep)
        with pytest.raises(OSError):  # 4 experts do not divide by EP=3: the view says why
            os.listdir(m.path / "topo" / "tp1-pp1-ep3")
        assert "do not divide by EP=3" in (m.path / "topo" / "ERRORS").read_text()
    first = torch.load(tmp_path / "l11.pt")
    assert first.abs().max() > 0
    for tp, ep in layouts[1:]:
        assert torch.allclose(torch.load(tmp_path / f"l{tp}{ep}.pt"), first, atol=1e-5, rtol=1e-4), (tp, ep)


def test_hand_split_tp2_model_matches_hf(mounter, tmp_path):
    """A small Llama-style model saved with dcp.save, then split TP=2 by hand
    (column-parallel w1/w3/output, row-parallel w2, vocab-parallel embedding)
    in two gloo processes that load only their rank file from topo/tp2-pp1: the
    same logits as the unsharded model loaded from hf/."""
    src = tmp_path / "ck"
    spawn("topo_tp_model.py", 1, "save", src)
    with mounter(src) as m:
        spawn("topo_tp_model.py", 1, "full", m.path / "hf", tmp_path / "full.pt")
        spawn("topo_tp_model.py", 2, "tp", m.path / "topo" / "tp2-pp1", tmp_path / "tp.pt")
    full, tp = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "tp.pt")
    assert torch.allclose(tp, full, atol=1e-5, rtol=1e-5)
    assert full.abs().max() > 0


def test_ls_topo(dcp_fixtures, mounter):
    with mounter(dcp_fixtures / "pp_w2") as m:
        assert os.listdir(m.path / "topo") == ["ERRORS"]  # DCP does not record its layout
        assert (m.path / "topo" / "tp2-pp2").is_dir()
        assert sorted(os.listdir(m.path / "topo")) == ["ERRORS", "tp2-pp2"]
        assert (m.path / "topo" / "ERRORS").read_text() == ""
        # cp and cmp of a rank file.
        out = m.path.parent / "copy.safetensors"
        assert run(["cp", str(m.path / "topo/tp2-pp2/tp1-pp1.safetensors"), str(out)]).returncode == 0
        assert run(["cmp", str(out), str(m.path / "topo/tp2-pp2/tp1-pp1.safetensors")]).returncode == 0

"""dcp/: any checkpoint as a PyTorch Distributed Checkpoint, read by torch's own
FileSystemReader, unmodified.

For checkpoints of every family ckptfs reads (committed fixtures written by
real producers, and DCP / DeepSpeed / Megatron checkpoints written during the
tests): torch's dcp_to_torch_save (FileSystemReader + dcp.load into an empty
state dict, nested by the metadata's planner_data) turns the mount's dcp/ into
one torch.save file whose every model.<fqn> and optim.state.<fqn>.<state>
equals the tensor ckptfs serves under params/ (model.<fqn> from the fp32
master where there is one); and dcp.load into DTensors at a world size the
source never had (3 ranks, Shard(0) and Shard(1)) gives the same tensors.
"""
import io
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import FIXTURES, ROOT, make_megatron_fixtures

torch = pytest.importorskip("torch")
ckptfs = pytest.importorskip("ckptfs", reason="the ckptfs package is not installed (scripts/test.sh installs it)")
import ckptfs.torch as ctorch  # noqa: E402

DATA = ROOT / "tests" / "data"
COMMITTED = [
    "dcp_single", "dcp_torch113/ckpt", "dcp_torch2x/2.0.1/ckpt", "dcp_torch2x/2.14.1/ckpt", "dcp_hf_sharded",
    "ds_py3112/z1_fp32_dp1", "ds_py3112/z2_fp32_dp3", "ds_py3112/z1_bf16_dp4", "ds_py3112/z2_bf16_tp2_dp2",
    "ds_py3112/bf16opt_dp2", "ds_py3112/padspan_z2_dp4", "ds_py3112/padspan_bf16opt_dp4", "ds_py3112/moe_z2_bf16_dp2_ep2",
    "meta_llama_mp2/mp2", "verl_fsdp2/global_step_1/actor", "verl_fsdp1/global_step_1/actor",
    "verl_hsdp/global_step_1/actor", "accelerate_fsdp1_rank",
    "megatron_versions/mcore0.14.0-dist_distopt_tp2_pp2_dp2", "megatron_versions/mcore0.15.0-dist_tp2_pp2",
    "megatron_wrappers/nemo2-dist_distopt_tp2_dp2/checkpoints", "megatron_wrappers/bridge-dist_distopt_tp2_dp2",
]


def expected(ck, key):
    """The tensor a dcp/ key stands for, read through ckptfs (params/'s bytes)."""
    by = {(t.name, t.state): t for t in ck.tensors()}
    own = [t for t in ck.tensors() if t.role == "other" and t.key == key]
    if own:  # an entry under its source key (a Megatron stack "optimizer.state.exp_avg.decoder...")
        return ctorch.read(ck, own[0].name, own[0].state)
    if key.startswith("model."):
        name = key[len("model."):]
        t = by.get((name, "fp32")) if (name, "fp32") in by and by[(name, "fp32")].dtype == "float32" else None
        if t is None or (name, "param") in by and tuple(by[(name, "param")].shape) != tuple(t.shape):
            t = by[(name, "param")]
        return ctorch.read(ck, t.name, t.state)
    for prefix in ("optim.state.", "optimizer.state."):  # the second: the alias Fabric and Accelerate load
        if not key.startswith(prefix):
            continue
        rest = key[len(prefix):]
        name, state = rest.rsplit(".", 1)
        return ctorch.read(ck, name, state)
    t = next(t for t in ck.tensors() if t.key == key)
    return ctorch.read(ck, t.name, t.state)


def same(a, b):
    """Bit for bit (NaN payloads and padding included): dtype, shape and bytes."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def flat(d, prefix=()):
    """dcp_to_torch_save's nested dict back to flat DCP keys."""
    for k, v in d.items():
        path = prefix + (str(k),)
        if isinstance(v, dict):
            yield from flat(v, path)
        elif isinstance(v, list):
            yield from flat(dict(enumerate(v)), path)
        else:
            yield ".".join(path), v


def ds_param_groups(src, ck=None):
    """DeepSpeed's param groups as torch's get_state_dict names them: the base
    optimizer's hyperparameters (DP rank 0, TP rank 0) and each group's FQNs
    from param_shapes, in order. A MoE expert group (`moe`, named ep_size_<E>)
    lists the experts of expert-parallel rank 0 under their local numbers;
    its members are every expert-parallel rank's experts, by the global number
    DeepSpeed's expert files give them (rank e's local l of L: e * L + l)."""
    import re
    tag = (src / "latest").read_text().strip()
    optim = next((src / tag).glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    osd = torch.load(optim, weights_only=False)["optimizer_state_dict"]
    groups = (osd.get("base_optimizer_state") or osd["optimizer_state_dict"])["param_groups"]
    shapes = torch.load(src / tag / "mp_rank_00_model_states.pt", weights_only=False).get("param_shapes")
    if shapes is None:
        # DeepSpeed <= 0.15's MoE checkpoints keep none: each group's names are
        # those its DP ranks' param_slice_mappings hold slices of, in rank order.
        shapes = [{} for _ in groups]
        for f in sorted((src / tag).glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt"),
                        key=lambda f: int(re.search(r"zero_pp_rank_(\d+)_", f.name).group(1))):
            maps = torch.load(f, weights_only=False)["optimizer_state_dict"]["param_slice_mappings"]
            for i, m in enumerate(maps):
                shapes[i].update(dict.fromkeys(m))

    def members(i, g):
        names = list(shapes[i])
        if not g.get("moe"):
            return names
        ep = int(re.fullmatch(r"ep_size_(\d+)", g["name"]).group(1))
        expert = re.compile(r"(.*\.deepspeed_experts\.)(\d+)(\..*)")
        local = {}  # per MoE layer (name prefix): its local experts
        for n in names:
            pre, num, _ = expert.fullmatch(n).groups()
            local.setdefault(pre, set()).add(int(num))
        return [f"{pre}{e * len(local[pre]) + int(num)}{rest}"
                for e in range(ep) for pre, num, rest in (expert.fullmatch(n).groups() for n in names)]

    out = {}
    for i, g in enumerate(groups):
        for k, v in g.items():
            out[f"optim.param_groups.{i}.{k}"] = members(i, g) if k == "params" else v
    return out


def verl_param_groups(src, ck=None):
    """verl's optimizer.state_dict() param groups with their integer ids as
    FQNs: verl lists ids in model.parameters() order, the model state dict's."""
    world = len(list(src.glob("model_world_size_*_rank_*.pt")))
    groups = torch.load(src / f"optim_world_size_{world}_rank_0.pt", weights_only=False)["param_groups"]
    names = list(torch.load(src / f"model_world_size_{world}_rank_0.pt", weights_only=False))
    ids = [i for g in groups for i in g["params"]]
    fqn = dict(zip(ids, names))
    return {f"optim.param_groups.{i}.{k}": [fqn[p] for p in v] if k == "params" else v
            for i, g in enumerate(groups) for k, v in g.items()}


def megatron_param_groups(src, ck):
    """A Megatron checkpoint's param groups (conftest.megatron_saved_param_groups),
    each group's members every parameter with its (weight decay, expert) key,
    as megatron-core's _get_param_groups assigns them by default. The
    non-distributed optimizer lists its members' ids (the distributed one
    deletes them): one per parameter of each stage, counted against it."""
    from conftest import megatron_saved_param_groups
    stages = megatron_saved_param_groups(src)
    shapes = {t.name: t.shape for t in ck.tensors() if t.role == "param" and not t.error}
    out = {}
    for i, g in enumerate(stages[0]):
        no_wd = g.get("wd_mult", g.get("weight_decay")) == 0
        expert = bool(g.get("is_expert_parallel", False))
        members = {n for n, s in shapes.items()
                   if (n.endswith(".bias") or len(s) == 1) == no_wd and (".experts." in n) == expert}
        assert members
        if "params" in g and not any(x.get("is_expert_parallel") for x in stages[0]):  # (EP ranks' files: local experts)
            assert sum(len(gs[i]["params"]) for gs in stages) == len(members), (i, len(members))
        for k, v in g.items():
            out[f"optim.param_groups.{i}.{k}"] = v
        out[f"optim.param_groups.{i}.params"] = members  # compared as a set
    return out


def check_view(src, tmp_path, mounter, groups_of=None):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    index = tmp_path / "index"
    ck = ckptfs.open(src, index)
    with mounter(src, index=index) as m:
        md = FileSystemReader(m.path / "dcp").read_metadata()
        readme = (m.path / "dcp" / "README.txt").read_text()
        out = tmp_path / "all.pt"
        dcp_to_torch_save(m.path / "dcp", out)
        # Every tensor item is a ZIP whose CRC-32s hold (torch.load does not
        # check them; Python's zipfile does).
        for index_, info in md.storage_data.items():
            if not isinstance(md.state_dict_metadata[index_.fqn], TensorStorageMetadata):
                continue
            with open(m.path / "dcp" / info.relative_path, "rb") as f:
                f.seek(info.offset)
                item = f.read(info.length)
            assert zipfile.ZipFile(io.BytesIO(item)).testzip() is None, index_
    loaded = dict(flat(torch.load(out, weights_only=False)))
    tensor_keys = [k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]
    assert tensor_keys, readme
    n_model = sum(k.startswith("model.") for k in tensor_keys)
    # One model.<fqn> per parameter: its weight or its fp32 master (ZeRO-3 saves only masters).
    names = {t.name for t in ck.tensors() if not t.error and
             (t.role == "param" or (t.state == "fp32" and t.dtype == "float32"))}
    assert n_model == len(names) or "Left out" in readme, (n_model, len(names))
    optim = [k for k in tensor_keys if k.startswith("optim.state.")]
    assert all("optimizer.state." + k[len("optim.state."):] in tensor_keys for k in optim), "no optimizer. alias"
    for key in tensor_keys:
        want = expected(ck, key)
        got = loaded[key]
        assert same(got, want), key
    # DeepSpeed, verl and Megatron save their param groups with integer ids
    # (or none): dcp/ offers them as get_state_dict names them, with FQNs
    # (under optimizer. too).
    if groups_of is not None:
        whole = torch.load(out, weights_only=False)  # (flat() would unroll the lists)
        groups = groups_of(src, ck)
        assert groups
        for k, v in groups.items():
            got, alias = whole[k], whole["optimizer." + k[len("optim."):]]
            if isinstance(v, set):
                got, alias = set(got), set(alias)
            assert got == v and alias == v, k
    # Everything the checkpoint has is represented, or named as left out.
    for t in ck.tensors():
        if t.error:
            assert t.key in readme, (t.key, readme)
    return md, tensor_keys


@pytest.mark.parametrize("rel", COMMITTED)
def test_committed_checkpoints_load_through_torchs_reader(rel, tmp_path, mounter):
    src = tmp_path / "ck"
    shutil.copytree(DATA / rel, src, ignore=shutil.ignore_patterns(".ckptfs"))
    # DeepSpeed (MoE's expert groups with every expert-parallel rank's experts), verl and Megatron
    # save param groups.
    groups_of = ds_param_groups if rel.startswith("ds_py3112/") else \
        verl_param_groups if rel.startswith(("verl_fsdp2", "verl_hsdp")) else \
        megatron_param_groups if rel.startswith(("megatron_versions/", "megatron_wrappers/")) else None
    check_view(src, tmp_path, mounter, groups_of)


@pytest.mark.parametrize("scenario", ["fsdp2_bf16_w2", "dtensor_dim1_w4", "zstd"])
def test_dcp_sources_round_trip(scenario, dcp_fixtures, tmp_path, mounter):
    md, keys = check_view(dcp_fixtures / scenario, tmp_path, mounter)
    if scenario == "fsdp2_bf16_w2":
        # An FSDP2 save's row blocks stay the chunks: a rank reads its own.
        assert any(len(md.state_dict_metadata[k].chunks) == 2 for k in keys)


MEGATRON = ["legacy_tp2_pp2", "dist_tp2_pp2_dp2", "zarr_tp2_pp2", "legacy_distopt_tp2_dp2", "legacy_moe_tp2_pp2_ep2",
            "dist_moe_tp2_pp2_ep2", "dist_moe_dpreshard_tp2_pp2_ep2"]


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    import os
    from test_megatron_mount import SCENARIOS
    base = os.environ.get("CKPTFS_FIXTURE_CACHE")
    root = Path(base) / "megatron" if base else tmp_path_factory.mktemp("megatron")
    return make_megatron_fixtures(root, {n: SCENARIOS[n] for n in MEGATRON})


@pytest.mark.parametrize("name", MEGATRON)
def test_megatron_sources(name, megatron, tmp_path, mounter):
    # Their param groups are offered with their members' FQNs.
    check_view(megatron / name, tmp_path, mounter, megatron_param_groups)


def test_deepspeed_zero3(tmp_path_factory, tmp_path, mounter):
    import os
    from test_deepspeed_mount import produce
    base = os.environ.get("CKPTFS_FIXTURE_CACHE")
    root = Path(base) / "deepspeed" if base else tmp_path_factory.mktemp("deepspeed")
    ck, _ = produce(root, "z3_fp32_dp2")
    check_view(ck, tmp_path, mounter)


def test_deepspeed_pipeline_with_tp_averaged_params(tmp_path_factory, tmp_path, mounter):
    """A Megatron-DeepSpeed (BLOOM-style) PipelineEngine checkpoint at TP=2 PP=2:
    TP-averaged parameters (means of replicas) and sub-parameters through dcp/."""
    import os
    from test_deepspeed_pipe import produce
    base = os.environ.get("CKPTFS_FIXTURE_CACHE")
    root = Path(base) / "deepspeed_pipe" if base else tmp_path_factory.mktemp("deepspeed_pipe")
    ck, _ = produce(root, "pp2_tp2_dp2_fp32_sub")
    check_view(ck, tmp_path, mounter)


@pytest.mark.parametrize("rel,dim1", [("ds_py3112/z2_bf16_tp2_dp2", False), ("ds_py3112/z2_bf16_tp2_dp2", True),
                                      ("ds_py3112/bf16opt_dp2", False), ("verl_fsdp2/global_step_1/actor", False),
                                      ("megatron_versions/mcore0.15.0-dist_tp2_pp2", False),
                                      ("meta_llama_mp2/mp2", True), ("accelerate_fsdp1_rank", False),
                                      ("dcp_torch2x/2.0.1/ckpt", False)])
def test_dtensors_at_a_new_world_size(rel, dim1, tmp_path, mounter):
    src = tmp_path / "ck"
    shutil.copytree(DATA / rel, src, ignore=shutil.ignore_patterns(".ckptfs"))
    index = tmp_path / "index"
    ck = ckptfs.open(src, index)
    out = tmp_path / "loaded.pt"
    with mounter(src, index=index) as m:
        cmd = [sys.executable, str(FIXTURES / "dcp_view_worker.py"), "--dcp", str(m.path / "dcp"), "--world", "3",
               "--out", str(out)] + (["--dim1"] if dim1 else [])
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=FIXTURES)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    loaded = torch.load(out, weights_only=False)
    assert loaded
    for key, got in loaded.items():
        assert same(got, expected(ck, key)), key


def test_a_refused_tensor_is_a_missing_key(tmp_path, mounter):
    """A tensor its reader refused is left out of dcp/ and named in README.txt;
    dcp.load of that key fails with torch's own missing-key error."""
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "ck"
    shutil.copytree(DATA / "ds_py3112/z1_fp32_dp1", src, ignore=shutil.ignore_patterns(".ckptfs"))
    # Truncate one optimizer file's flat partition: its states become refused tensors.
    opt = next(src.rglob("*optim_states.pt"))
    data = opt.read_bytes()
    opt.write_bytes(data[: len(data) // 2])
    index = tmp_path / "index"
    ck = ckptfs.open(src, index)
    broken = [t for t in ck.tensors() if t.error]
    if not broken:
        pytest.skip("the damaged file made no tensor refused (the reader failed the whole checkpoint)")
    with mounter(src, index=index) as m:
        readme = (m.path / "dcp" / "README.txt").read_text()
        t = broken[0]
        assert t.key in readme
        key = f"optim.state.{t.name}.{t.state}" if t.role == "optim_state" else f"model.{t.name}"
        assert f"{key}" not in readme.split("Left out")[0]
        sd = {key: torch.zeros(t.shape, dtype=getattr(torch, t.dtype))}
        # A refused master leaves model.<fqn> to the weight; the master's own key is then absent.
        with pytest.raises(BaseException) as ei:  # CheckpointException is a BaseException
            dcp.load(sd, checkpoint_id=m.path / "dcp", no_dist=True)
        assert f"Missing key in checkpoint state_dict: {key}" in str(ei.value) + repr(getattr(ei.value, "failures", "")), \
            str(ei.value)


@pytest.mark.parametrize("rel", ["ds_py3112/z2_bf16_tp2_dp2", "verl_fsdp2/global_step_1/actor", "meta_llama_mp2/mp2"])
def test_storage_reader_answers_from_the_same_plan(rel, tmp_path, mounter):
    """ckptfs.torch.StorageReader(view="dcp") without a mount: the same .metadata
    bytes as the mount's dcp/, and dcp.load through it equals torch's reader on the mount."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    src = tmp_path / "ck"
    shutil.copytree(DATA / rel, src, ignore=shutil.ignore_patterns(".ckptfs"))
    index = tmp_path / "index"
    reader = ctorch.StorageReader(src, index=str(index), view="dcp")
    md = reader.read_metadata()
    with mounter(src, index=index) as m:
        assert (m.path / "dcp" / ".metadata").read_bytes() == ckptfs.open(src, index).open_file("dcp/.metadata").read()
        keys = [k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]
        a = {k: torch.zeros(tuple(md.state_dict_metadata[k].size), dtype=md.state_dict_metadata[k].properties.dtype)
             for k in keys}
        b = {k: v.clone() for k, v in a.items()}
        dcp.load(a, storage_reader=FileSystemReader(m.path / "dcp"), no_dist=True)
    dcp.load(b, storage_reader=ctorch.StorageReader(src, index=str(index), view="dcp"), no_dist=True)
    for k in keys:
        assert same(a[k], b[k]), k


def test_the_next_mount_serves_the_saved_plan(tmp_path, mounter):
    """The first mount plans dcp/ and keeps the plan beside the index; the next
    mount of that index lists dcp/ from it (no planning) and torch's reader
    loads the same tensors. A damaged plan file is planned again and replaced."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src = tmp_path / "ck"
    shutil.copytree(DATA / "ds_py3112/z2_bf16_tp2_dp2", src, ignore=shutil.ignore_patterns(".ckptfs"))
    index = tmp_path / "index"
    outs, trees = [], []
    for name in ("first", "second", "damaged"):
        if name == "damaged":
            plan = index / "dcp.plan"
            data = bytearray(plan.read_bytes())
            data[len(data) // 2] ^= 0x01
            plan.write_bytes(bytes(data))
        with mounter(src, name=name, index=index) as m:
            tree = {p.name: p.read_bytes() for p in sorted((m.path / "dcp").iterdir())}
            out = tmp_path / f"{name}.pt"
            dcp_to_torch_save(m.path / "dcp", out)
            log = m.log_text()
        assert (index / "dcp.plan").is_file()
        assert ("dcp/ as planned before" in log) == (name == "second"), log
        assert "not kept for the next mount" not in log, log
        outs.append(dict(flat(torch.load(out, weights_only=False))))
        trees.append(tree)
    assert trees[0] == trees[1] == trees[2]
    assert outs[0].keys() == outs[1].keys() == outs[2].keys()
    for k, v in outs[0].items():
        if isinstance(v, torch.Tensor):
            assert same(v, outs[1][k]) and same(v, outs[2][k]), k
        else:
            assert v == outs[1][k] == outs[2][k], k

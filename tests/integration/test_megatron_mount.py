"""Megatron-LM checkpoints written by the real megatron-core (CPU, gloo) through
a real ckptfs mount: legacy torch format at TP 1/2/4 x PP 1/2 (+ virtual
pipeline, distributed optimizer), torch_dist and the zarr layout.

Every tensor is compared with a reference merged here, independently of
ckptfs, from what mcore itself held on each rank (tests/fixtures/make_megatron.py
dumps each rank's local tensors and, through the optimizer's own parameter ->
state maps, its fp32 master and Adam states)."""
import errno
import filecmp
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash

from conftest import FIXTURES, ckptfs_bin, make_megatron_fixtures, run

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

LAYERS = 4
SCENARIOS = {
    "legacy_tp1_pp1": ["legacy", "--tp", "1", "--pp", "1"],
    "legacy_tp2_pp2": ["legacy", "--tp", "2", "--pp", "2", "--bf16"],
    "legacy_tp4_pp1": ["legacy", "--tp", "4", "--pp", "1", "--bf16"],
    "legacy_tp1_pp2_vp2": ["legacy", "--tp", "1", "--pp", "2", "--vp", "2", "--bf16"],
    "legacy_distopt_tp2_dp2": ["legacy", "--tp", "2", "--dp", "2", "--dist-opt", "--bf16"],
    "legacy_distopt_tp2_pp2_dp2": ["legacy", "--tp", "2", "--pp", "2", "--dp", "2", "--dist-opt", "--bf16"],
    "legacy_drift_tp2": ["legacy", "--tp", "2", "--bf16", "--drift"],
    "legacy_names_tp2_pp2": ["legacy", "--tp", "2", "--pp", "2", "--legacy-names"],
    "dist_tp2_pp2_dp2": ["dist", "--tp", "2", "--pp", "2", "--dp", "2", "--bf16"],
    # mcore >= 0.15's default: the distributed optimizer's per-bucket states
    # (several buckets per buffer: overlap_grad_reduce with a small bucket size).
    "dist_dpreshard_tp2_pp2_dp2": ["dist", "--tp", "2", "--pp", "2", "--dp", "2", "--bf16", "--dist-opt",
                                   "--optim", "dp_reshardable", "--bucket-size", "2000"],
    # megatron-core driven without Megatron-LM's loop: no args in common.pt, no
    # run config; the layout is read from the checkpoint and checked per bucket.
    "dist_noargs_dpreshard_tp2_pp2_dp2": ["dist", "--tp", "2", "--pp", "2", "--dp", "2", "--bf16", "--dist-opt",
                                          "--optim", "dp_reshardable", "--bucket-size", "2000", "--no-args"],
    # The older default: DP rank 0's gathered buffers in one ShardedObject, buckets
    # coalesced (their sizes come from the replay and args.ddp_bucket_size).
    "dist_dpzero_tp2_pp2_dp2": ["dist", "--tp", "2", "--pp", "2", "--dp", "2", "--bf16", "--dist-opt",
                                "--optim", "dp_zero_gather_scatter", "--bucket-size", "2000"],
    # MoE: 4 experts per layer over expert-parallel size 2 (mp_rank_TT_PPP_EEE),
    # a dense and an expert optimizer (ChainedOptimizer).
    "legacy_moe_tp2_pp2_ep2": ["legacy", "--tp", "2", "--pp", "2", "--dp", "2", "--ep", "2", "--experts", "4",
                               "--bf16"],
    "legacy_moe_distopt_tp2_pp2_ep2": ["legacy", "--tp", "2", "--pp", "2", "--dp", "2", "--ep", "2", "--experts", "4",
                                       "--bf16", "--dist-opt"],
    "dist_moe_tp2_pp2_ep2": ["dist", "--tp", "2", "--pp", "2", "--dp", "2", "--ep", "2", "--experts", "4", "--bf16"],
    # The newest default with MoE: dense and expert distributed optimizers
    # (chained_0. / chained_1.), the expert buffers per EP rank.
    "dist_moe_dpreshard_tp2_pp2_ep2": ["dist", "--tp", "2", "--pp", "2", "--dp", "2", "--ep", "2", "--experts", "4",
                                       "--bf16", "--dist-opt", "--optim", "dp_reshardable", "--bucket-size", "2000"],
    "zarr_tp2_pp2": ["zarr", "--tp", "2", "--pp", "2", "--bf16"],
    "zarr_lostwrites_tp2": ["zarr", "--tp", "2", "--bf16", "--lost-writes"],
}
CLEAN = [s for s in SCENARIOS if "drift" not in s and "lostwrites" not in s]


def topology(args):
    get = lambda k, d: int(args[args.index(k) + 1]) if k in args else d
    return get("--tp", 1), get("--pp", 1), get("--dp", 1), get("--vp", 1)


@pytest.fixture(scope="session")
def megatron_fixtures(tmp_path_factory):
    cache = os.environ.get("CKPTFS_FIXTURE_CACHE")
    return make_megatron_fixtures(Path(cache) / "megatron" if cache else tmp_path_factory.mktemp("megatron"), SCENARIOS)


def split_rule(name):
    """Megatron's TP split, written from megatron/core/tensor_parallel/layers.py."""
    if "layernorm" in name or "layer_norm" in name or "position_embeddings" in name or ".router." in name:
        return "replicated"
    if ".linear_proj." in name or ".linear_fc2." in name:
        return "replicated" if name.endswith(".bias") else "row"
    if ".linear_fc1." in name:
        return "swiglu"
    return "column"


def merge(rule, shards):
    if rule == "replicated":
        return shards[0]
    if rule == "row":
        return torch.cat(shards, 1)
    if rule == "swiglu":  # each rank holds [W_r; V_r]; global [W_0..W_n; V_0..V_n]
        halves = [s.chunk(2, 0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    return torch.cat(shards, 0)


# mcore's local layer spec saves norms under the fused-layer names in sharded state dicts.
SHARDED_KEYS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


LEGACY_NAMES = [("embedding.", "language_model.embedding."),
                ("decoder.final_layernorm.", "language_model.encoder.final_layernorm."),
                ("decoder.layers.", "language_model.encoder.layers."), ("output_layer.", "language_model.output_layer."),
                ("self_attention.linear_qkv.", "self_attention.query_key_value."),
                ("self_attention.linear_proj.", "self_attention.dense."), ("pre_mlp_layernorm.", "post_attention_layernorm."),
                ("mlp.linear_fc1.", "mlp.dense_h_to_4h."), ("mlp.linear_fc2.", "mlp.dense_4h_to_h.")]


def global_name(local, pp_rank, chunk, pp, vp, sharded=False, legacy=False):
    if legacy:
        for a, b in LEGACY_NAMES:
            local = local.replace(a, b, 1) if a in local else local
    if sharded:
        for a, b in SHARDED_KEYS.items():
            local = local.replace(a, b)
    parts = local.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        offset = chunk * (LAYERS // vp) + pp_rank * (LAYERS // pp // vp)
        parts[i + 1] = str(int(parts[i + 1]) + offset)
    return ".".join(parts)


def renumber_expert(name, offset):
    parts = name.split(".")
    if "local_experts" not in parts:
        return name
    i = parts.index("local_experts")
    parts[i + 1] = str(int(parts[i + 1]) + offset)
    return ".".join(parts)


def reference(fixture, args):
    """{global name: {param, fp32, exp_avg, exp_avg_sq}} merged from the rank dumps.
    MoE: dense parameters from the first expert-parallel rank, each rank's local
    experts renumbered to global ones (EP rank x local experts), their optimizer
    ranges merged over that rank's expert-data-parallel group."""
    tp, pp, dp, vp = topology(args[1:])
    dumps = {(t, p, d): torch.load(fixture / "reference" / f"tp{t}_pp{p}_dp{d}.pt", weights_only=False)
             for t in range(tp) for p in range(pp) for d in range(dp)}
    out = {}
    for p in range(pp):
        ep_of = {d: dumps[(0, p, d)].get("ep_rank", 0) for d in range(dp)}
        for e in sorted(set(ep_of.values())):
            group = [d for d in range(dp) if ep_of[d] == e]
            keys = dumps[(0, p, group[0])]["model"]
            local_experts = len({k.split("local_experts.")[1].split(".")[0] for k in keys if "local_experts." in k})
            for key in keys:
                expert = ".local_experts." in key
                if not expert and e != min(ep_of.values()):
                    continue
                ranks = group if expert else range(dp)
                chunk, local = key.split("/", 1)
                rule = split_rule(local)
                name = global_name(local, p, int(chunk), pp, vp, sharded=args[0] != "legacy",
                                   legacy="--legacy-names" in args)
                name = renumber_expert(name, e * local_experts)
                entry = {"param": merge(rule, [dumps[(t, p, ranks[0])]["model"][key] for t in range(tp)])}
                for state in ("fp32", "exp_avg", "exp_avg_sq"):
                    shards = []
                    for t in range(tp):
                        shape = dumps[(t, p, ranks[0])]["model"][key].shape
                        flat = torch.full((int(np.prod(shape)),), float("nan"))
                        for d in ranks:
                            o = dumps[(t, p, d)]["optim"].get(key)
                            if o is not None:
                                a, b = o["range"]
                                flat[a:b] = o[state].float()
                        assert not torch.isnan(flat).any(), f"DP ranks do not cover {key} {state}"
                        shards.append(flat.view(shape))
                    entry[state] = merge(rule, shards)
                assert name not in out, name
                out[name] = entry
    return out


def mount_src(fixture, kind):
    return fixture  # the save directory: ckptfs follows latest_checkpointed_iteration.txt


# Checkpoints written by older megatron-core releases (committed; made by
# tests/fixtures/make_megatron_versions.sh): name -> producer arguments.
VERSIONED = {"mcore0.15.0-dist_tp2_pp2": ["dist", "--tp", "2", "--pp", "2", "--bf16"],
             "mcore0.14.0-dist_distopt_tp2_pp2_dp2": ["dist", "--tp", "2", "--pp", "2", "--dp", "2", "--bf16",
                                                      "--dist-opt", "--optim", "fully_sharded_model_space"]}
VERSIONED_DIR = Path(__file__).resolve().parents[1] / "data" / "megatron_versions"


@pytest.mark.parametrize("scenario", CLEAN)
def test_every_tensor_equals_the_reference_merge(megatron_fixtures, mounter, scenario):
    check_against_reference(megatron_fixtures / scenario, SCENARIOS[scenario], mounter)


@pytest.mark.parametrize("scenario", sorted(VERSIONED))
def test_older_megatron_core_releases(mounter, tmp_path, scenario):
    """megatron-core 0.15 pickles MCoreMetadata (its Metadata subclass) in
    .metadata, 0.14 MCoreSavePlan objects and its distributed optimizer's
    default N-D flattened states (fully_sharded_model_space): every weight and
    optimizer state equals what mcore held on each rank."""
    src = tmp_path / scenario
    shutil.copytree(VERSIONED_DIR / scenario, src)  # the index goes beside it, not into the repo
    check_against_reference(src, VERSIONED[scenario], mounter)


# The same model saved through Megatron-Core's wrappers (committed; made by
# tests/fixtures/make_megatron_wrappers.sh): NeMo 2 and Megatron-Bridge, the
# distributed optimizer in its default dp_reshardable layout.
WRAPPED_ARGS = ["dist", "--tp", "2", "--dp", "2", "--bf16", "--dist-opt", "--optim", "dp_reshardable"]
WRAPPED_DIR = Path(__file__).resolve().parents[1] / "data" / "megatron_wrappers"
WRAPPED = ("bridge-dist_distopt_tp2_dp2", "nemo2-dist_distopt_tp2_dp2")
NEMO2 = "nemo2-dist_distopt_tp2_dp2"
NEMO2_LAST = "default--reduced_train_loss=1.2345-epoch=0-step=6-consumed_samples=14.0-last"


@pytest.mark.parametrize("root", ["bridge", "nemo2-checkpoints", "nemo2-checkpoint"])
def test_megatron_wrapper_roots(mounter, bin_path, tmp_path, root):
    """The directory a NeMo 2 or Megatron-Bridge user has mounts as the
    checkpoint: Bridge's save directory (its tracker; the layout from
    run_config.yaml), NeMo 2's checkpoints/ directory and one checkpoint in it
    (weights/, "module." prefixes, global_step; the layout from context/'s
    model.yaml and io.json). Every weight and every Adam state equals what mcore
    held; verify is clean."""
    name = "bridge-dist_distopt_tp2_dp2" if root == "bridge" else NEMO2
    fx = tmp_path / name
    shutil.copytree(WRAPPED_DIR / name, fx)  # the index goes beside it, not into the repo
    src = {"bridge": fx, "nemo2-checkpoints": fx / "checkpoints",
           "nemo2-checkpoint": fx / "checkpoints" / NEMO2_LAST}[root]
    check_against_reference(fx, WRAPPED_ARGS, mounter, src=src)
    rc, rep = verify_json(bin_path, src)
    assert rep["findings"] == [] and rc == 0, rep["findings"]
    r = run([bin_path, "info", str(src)])
    assert ("run_config.yaml" if root == "bridge" else "context/model.yaml and io.json") in r.stdout, r.stdout[:600]


def test_nemo2_checkpoint_without_context(mounter, tmp_path):
    """weights/ without context/ (copied alone, or a NeMo that did not write
    it): TP and SwiGLU come from how mcore sharded the weights, which all map;
    the distributed-optimizer layout (layers, PP, tied embeddings) is read from
    the checkpoint too and checked per bucket, so every state maps as well."""
    fx = tmp_path / NEMO2
    shutil.copytree(WRAPPED_DIR / NEMO2, fx)
    shutil.rmtree(fx / "checkpoints" / NEMO2_LAST / "context")
    ref = reference(fx, WRAPPED_ARGS)
    with mounter(fx / "checkpoints" / NEMO2_LAST) as m:
        info = json.loads((m.path / "checkpoint.json").read_text())
        assert info["step"] == 7
        assert "NeMo 2 checkpoint" in info["format"] and "TP 2, SwiGLU read from the chunk geometry" in info["format"]
        assert "distributed-optimizer layout read from the checkpoint" in info["format"], info["format"]
        assert not any("not mapped" in p for p in info["problems"]), info["problems"]
        for name, r in ref.items():
            np.testing.assert_array_equal(np.load(m.path / "params" / name / "param.npy"), r["param"].float().numpy())
            for state in ("fp32", "exp_avg", "exp_avg_sq"):
                np.testing.assert_array_equal(np.load(m.path / "params" / name / f"{state}.npy"),
                                              r[state].float().numpy(), err_msg=(name, state))
        # topo/ splits linear_fc1 as two SwiGLU halves: each TP=4 rank holds [W_r; V_r].
        from safetensors.torch import load_file
        layout = json.loads((m.path / "topo/tp4-pp1/layout.json").read_text())
        fc1 = ref["decoder.layers.1.mlp.linear_fc1.weight"]["param"]
        w, v = fc1.chunk(2, 0)
        for t, rank in enumerate(layout["ranks"]):
            got = load_file(str(m.path / "topo/tp4-pp1" / rank["file"]))["decoder.layers.1.mlp.linear_fc1.weight"]
            assert torch.equal(got, torch.cat([w.chunk(4, 0)[t], v.chunk(4, 0)[t]], 0)), t


def test_nemo2_checkpoints_directory_skips_an_unfinished_save(mounter, tmp_path, bin_path):
    """A newer *last save with NeMo's -unfinished marker beside it is skipped
    (AutoResume would not resume from it); when it is the only one, the mount
    is refused with the reason."""
    fx = tmp_path / NEMO2
    shutil.copytree(WRAPPED_DIR / NEMO2, fx)
    ckpts = fx / "checkpoints"
    newer = "default--reduced_train_loss=1.2000-epoch=0-step=9-consumed_samples=20.0-last"
    shutil.copytree(ckpts / NEMO2_LAST, ckpts / newer)
    (ckpts / newer / "weights" / "__0_0.distcp").write_bytes(b"partial")  # the save was cut off
    (ckpts / (newer + "-unfinished")).touch()
    r = run([bin_path, "info", str(ckpts)])
    assert r.returncode == 0, r.stderr
    assert NEMO2_LAST in r.stdout and "1 unfinished skipped" in r.stdout and "step        7" in r.stdout, r.stdout[:800]
    shutil.rmtree(ckpts / NEMO2_LAST)
    r = run([bin_path, "info", str(ckpts)])
    assert r.returncode != 0 and "unfinished" in r.stderr and newer in r.stderr, r.stderr


def is_vocabulary(name):
    return "word_embeddings" in name or name.endswith("output_layer.weight")


def vocab_of(mount):
    """args.vocab_size where the checkpoint records args (else None)."""
    p = mount.path / "args.json"
    return json.loads(p.read_text()).get("vocab_size") if p.exists() else None


def as_served(name, t, vocab):
    """params/'s rule: a vocabulary's rows cut to the true vocabulary where
    the checkpoint records it; the TP padding rows are <state>.vocab_padding.npy."""
    return t[:vocab] if vocab and is_vocabulary(name) and t.shape[0] > vocab else t


def check_against_reference(fx, args, mounter, src=None):
    ref = reference(fx, args)
    with mounter(src or fx) as m:
        params = m.path / "params"
        shown = {p.name for p in params.iterdir()}
        assert set(ref) <= shown, sorted(set(ref) - shown)[:5]
        # params/ cuts a vocabulary to args.vocab_size (the rows before
        # Megatron's TP padding); the padding rows are <state>.vocab_padding.npy.
        vocab = vocab_of(m)
        for name, r in ref.items():
            cut = as_served(name, r["param"], vocab) is not r["param"]
            for state in ("param", "fp32", "exp_avg", "exp_avg_sq"):
                want = r[state]
                if cut:
                    pad = np.load(params / name / f"{state}.vocab_padding.npy")
                    np.testing.assert_array_equal(pad, want[vocab:].float().numpy(), err_msg=f"{name} {state}")
                    want = want[:vocab]
                got = np.load(params / name / f"{state}.npy")
                assert got.shape == tuple(want.shape), (name, state)
                np.testing.assert_array_equal(got, want.float().numpy(), err_msg=f"{name} {state}")
            raw = (params / name / "param.raw").read_bytes()
            want = as_served(name, r["param"], vocab)
            assert raw == want.contiguous().view(torch.uint8).numpy().tobytes(), name
        info = json.loads((m.path / "checkpoint.json").read_text())
        assert info["step"] == 7
        assert not info.get("problems"), info.get("problems")


@pytest.mark.parametrize("scenario", ["legacy_tp2_pp2", "dist_tp2_pp2_dp2"])
def test_cp_and_cmp_through_the_mount(megatron_fixtures, mounter, tmp_path, scenario):
    with mounter(megatron_fixtures / scenario) as m:
        out = tmp_path / "copy"
        subprocess.run(["cp", "-r", str(m.path / "params"), str(out)], check=True, timeout=300)
        cmp = filecmp.dircmp(str(m.path / "params"), str(out))
        assert not cmp.left_only and not cmp.right_only
        name = "decoder.layers.3.mlp.linear_fc1.weight"
        r = subprocess.run(["cmp", str(m.path / "params" / name / "param.npy"), str(out / name / "param.npy")])
        assert r.returncode == 0


def test_replica_drift_is_reported_and_rank0_served(megatron_fixtures, mounter):
    fx = megatron_fixtures / "legacy_drift_tp2"
    rank0 = torch.load(fx / "reference" / "tp0_pp0_dp0.pt", weights_only=False)["model"]
    with mounter(fx) as m:
        info = json.loads((m.path / "checkpoint.json").read_text())
        drift = [p for p in info["problems"] if "replica drift" in p]
        assert len(drift) == 1, info["problems"]
        assert "decoder.layers.0.input_layernorm.weight" in drift[0] and "max |diff| 0.5" in drift[0]
        got = np.load(m.path / "params/decoder.layers.0.input_layernorm.weight/param.npy")
        np.testing.assert_array_equal(got, rank0["0/decoder.layers.0.input_layernorm.weight"].float().numpy())


def test_legacy_args_and_layout(megatron_fixtures, mounter):
    with mounter(megatron_fixtures / "legacy_tp2_pp2") as m:
        args = json.loads((m.path / "args.json").read_text())
        assert args["num_layers"] == LAYERS and args["tensor_model_parallel_size"] == 2
        assert args["params_dtype"] == "torch.bfloat16"
        # One rule for params/ in every family: the true vocabulary, the TP
        # padding rows beside it (and described in info.json).
        d = m.path / "params/embedding.word_embeddings.weight"
        assert args["vocab_size"] < args["padded_vocab_size"]
        assert np.load(d / "param.npy").shape == (args["vocab_size"], 32)
        pad_rows = args["padded_vocab_size"] - args["vocab_size"]
        assert np.load(d / "param.vocab_padding.npy").shape == (pad_rows, 32)
        assert np.load(d / "exp_avg.vocab_padding.npy").shape == (pad_rows, 32)
        entry = json.loads((d / "info.json").read_text())["tensors"]["param"]
        assert entry["shape"] == [args["vocab_size"], 32] and entry["bytes"] == args["vocab_size"] * 32 * 2
        raw = (d / "param.raw").read_bytes()
        assert entry["xxh3_64_raw"] == xxhash.xxh3_64_hexdigest(raw)
        vp = entry["vocab_padding"]
        assert vp["file"] == "param.vocab_padding.npy" and vp["rows"] == pad_rows
        assert vp["stored_shape"] == [args["padded_vocab_size"], 32]
        assert vp["xxh3_64_raw"] == xxhash.xxh3_64_hexdigest((d / "param.vocab_padding.raw").read_bytes())
        assert len(raw) == args["vocab_size"] * 32 * 2
    r = run([str(Path(os.environ.get("CKPTFS_BIN", "build/ckptfs")).resolve()), "info",
             str(megatron_fixtures / "legacy_tp1_pp2_vp2")])
    assert r.returncode == 0 and "VP=2" in r.stdout, r.stdout + r.stderr


def test_torch_dist_stacked_layers_whole_under_other(megatron_fixtures, mounter):
    fx = megatron_fixtures / "dist_tp2_pp2_dp2"
    ref = reference(fx, SCENARIOS["dist_tp2_pp2_dp2"])
    with mounter(fx) as m:
        whole = np.load(m.path / "other/decoder.layers.mlp.linear_fc1.weight.npy")
        assert whole.shape[0] == LAYERS
        for i in range(LAYERS):
            np.testing.assert_array_equal(whole[i], ref[f"decoder.layers.{i}.mlp.linear_fc1.weight"]["param"].float().numpy())
        assert (m.path / "other/common.pt").stat().st_size > 0
        # Opened by name, never listed: a copy of the tree holds each byte once.
        listed = os.listdir(m.path / "other")
        assert "decoder.layers.mlp.linear_fc1.weight.npy" not in listed and "common.pt" in listed
        assert json.loads((m.path / "checkpoint.json").read_text())["counts"]["other_unlisted"] > 0


def test_zarr_missing_chunk_is_eio_not_zeros(megatron_fixtures, mounter, tmp_path):
    src = tmp_path / "zarr"
    shutil.copytree(megatron_fixtures / "zarr_tp2_pp2", src, ignore=shutil.ignore_patterns(".ckptfs"))
    arr = src / "iter_0000007" / "decoder.layers.mlp.linear_fc1.weight"
    chunk = sorted(p for p in arr.iterdir() if not p.name.startswith("."))[-1]
    chunk.unlink()
    with mounter(src) as m:
        info = json.loads((m.path / "checkpoint.json").read_text())
        assert any(chunk.name in p and "missing" in p for p in info["problems"]), info["problems"]
        with pytest.raises(OSError) as e:
            (m.path / "params/decoder.layers.3.mlp.linear_fc1.weight/param.raw").read_bytes()
        assert e.value.errno == 5
        assert np.load(m.path / "params/decoder.layers.0.mlp.linear_fc1.weight/param.npy").shape == (64, 32)
        assert chunk.name in m.log_text()


def test_legacy_missing_rank_and_truncated_file(megatron_fixtures, mounter, tmp_path, bin_path):
    src = tmp_path / "broken"
    shutil.copytree(megatron_fixtures / "legacy_tp2_pp2", src, ignore=shutil.ignore_patterns(".ckptfs", "reference"))
    shutil.rmtree(src / "iter_0000007" / "mp_rank_01_001")
    with open(src / "iter_0000007" / "mp_rank_00_000" / "model_optim_rng.pt", "r+b") as f:
        f.truncate(1000)
    r = run([bin_path, "info", str(src)])
    assert r.returncode != 0
    assert "mp_rank_00_000/model_optim_rng.pt" in r.stderr and "truncated" in r.stderr, r.stderr[-2000:]
    with mounter(src) as m:
        info = json.loads((m.path / "checkpoint.json").read_text())
        text = "\n".join(info["problems"])
        assert "mp_rank_01_001/model_optim_rng.pt is missing" in text
        with pytest.raises(OSError) as e:
            (m.path / "params/decoder.layers.3.mlp.linear_fc1.weight/param.raw").read_bytes()
        assert e.value.errno == 5
        with pytest.raises(OSError) as e:
            (m.path / "params/decoder.layers.0.mlp.linear_fc1.weight/param.raw").read_bytes()
        assert e.value.errno == 5
        assert "mp_rank_00_000/model_optim_rng.pt" in m.log_text()


def test_legacy_moe_missing_expert_parallel_rank(megatron_fixtures, mounter, tmp_path, bin_path):
    """One EP rank directory gone: exactly the experts it held are EIO (with the
    missing file in the log and a coverage finding); dense weights, the other
    EP rank's experts and their optimizer states are served."""
    src = tmp_path / "moe"
    shutil.copytree(megatron_fixtures / "legacy_moe_tp2_pp2_ep2", src, ignore=shutil.ignore_patterns(".ckptfs"))
    shutil.rmtree(src / "iter_0000007" / "mp_rank_01_001_001")
    ref = reference(megatron_fixtures / "legacy_moe_tp2_pp2_ep2", SCENARIOS["legacy_moe_tp2_pp2_ep2"])
    with mounter(src) as m:
        params = m.path / "params"
        for layer in (2, 3):
            for e in (2, 3):
                name = f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc1.weight"
                assert read_errno(params / name / "param.raw") == 5, name
        assert "EP rank 1 (" in m.log_text() and "mp_rank_01_001_001/model_optim_rng.pt), which is missing" in m.log_text()
        for name in ["decoder.layers.3.mlp.router.weight", "decoder.layers.3.self_attention.linear_qkv.weight",
                     "decoder.layers.3.mlp.experts.local_experts.1.linear_fc2.weight",
                     "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]:
            np.testing.assert_array_equal(np.load(params / name / "param.npy"), ref[name]["param"].float().numpy())
            np.testing.assert_array_equal(np.load(params / name / "exp_avg.npy"), ref[name]["exp_avg"].numpy())
    rc, report = verify_json(bin_path, src)
    assert rc != 0
    assert any(f["check"] == "coverage" and "mp_rank_01_001_001" in f["message"] for f in report["findings"]), report


def verify_json(bin_path, src):
    r = run([bin_path, "verify", str(src), "--json"])
    return r.returncode, json.loads(r.stdout)


@pytest.mark.parametrize("scenario", CLEAN)
def test_verify_clean_fixtures_have_no_finding(megatron_fixtures, bin_path, scenario):
    rc, rep = verify_json(bin_path, megatron_fixtures / scenario)
    assert rep["findings"] == [] and rc == 0, rep["findings"]
    assert rep["summary"]["tensors_read"] > 0


def test_verify_reports_layernorm_drift_on_tp_rank_1(megatron_fixtures, bin_path):
    """TP=2, rank 1's copy of a layer norm perturbed after the step: found by hash,
    measured by value."""
    rc, rep = verify_json(bin_path, megatron_fixtures / "legacy_drift_tp2")
    assert rc == 3
    [f] = rep["findings"]
    assert f["check"] == "replica-drift" and f["tensor"] == "decoder.layers.0.input_layernorm.weight"
    d = f["detail"]
    assert d["max_abs_diff"] == 0.5 and d["differing_elements"] == 1
    assert d["copies"][0]["xxh3"] != d["copies"][1]["xxh3"]
    assert d["copies"][1]["file"].endswith("mp_rank_01/model_optim_rng.pt")


def test_verify_reports_zarr_lost_writes(megatron_fixtures, bin_path, mounter):
    """Megatron zarr #1053: the array creators' exp_avg_sq writes were lost, their
    chunks hold zeros while exp_avg of the same region does not."""
    fx = megatron_fixtures / "zarr_lostwrites_tp2"
    rc, rep = verify_json(bin_path, fx)
    assert rc == 3
    zeroed = [f for f in rep["findings"] if f["check"] == "zeroed-optimizer-state"]
    assert zeroed and len(zeroed) == len(rep["findings"])
    assert all("exp_avg_sq" in f["tensor"] and f["detail"]["step"] == 7 for f in zeroed)
    # Every param's first chunk (the creator's) is flagged; the other TP rank's is not.
    emb = next(f for f in zeroed if "word_embeddings" in f["tensor"])
    assert emb["detail"]["zero_chunks"] == 1 and emb["detail"]["chunks"] == 2
    region = emb["detail"]["regions"][0]["region"]  # "[0:32, 0:32]"
    rows = [int(x) for x in region.strip("[]").split(",")[0].split(":")]
    with mounter(fx) as m:
        sq = np.load(m.path / "params/embedding.word_embeddings.weight/exp_avg_sq.npy")
        avg = np.load(m.path / "params/embedding.word_embeddings.weight/exp_avg.npy")
        assert not sq[rows[0]:rows[1]].any() and sq[rows[1]:].any()
        assert avg[rows[0]:rows[1]].any()
        mounted = json.loads((m.path / ".ckptfs/report.json").read_text())
        assert [f["message"] for f in mounted["findings"]] == [f["message"] for f in rep["findings"]]


def test_hostile_zarr_arrays(megatron_fixtures, mounter, tmp_path):
    """A .zarray with a huge leading dimension (drove `info` to 6 GB) and one
    that is not JSON: each array is refused with its file named, with bounded
    memory; verify reports both (exit 1); hf/ERRORS and topo/ERRORS say what
    the views leave out; every other tensor still reads."""
    import json
    import shutil
    ck = tmp_path / "ck"
    shutil.copytree(megatron_fixtures / "zarr_tp2_pp2", ck, ignore=shutil.ignore_patterns(".ckptfs"))
    it = next(ck.glob("iter_*"))
    huge = it / "decoder.layers.mlp.linear_fc2.weight" / ".zarray"
    z = json.loads(huge.read_text())
    z["shape"][0] = 1 << 40
    huge.write_text(json.dumps(z))
    (it / "decoder.final_layernorm.weight" / ".zarray").write_text("{")
    ix = tmp_path / "ix"
    r = subprocess.run([sys.executable, "-c", "import resource, subprocess, sys;"
                        "r = subprocess.run(sys.argv[1:], capture_output=True, text=True);"
                        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); print(r.returncode);"
                        "sys.stderr.write(r.stderr)", ckptfs_bin(), "info", str(ck), "--index", str(ix)],
                       capture_output=True, text=True, timeout=300)
    peak_kib, rc = (int(x) for x in r.stdout.split()[:2])
    assert rc == 1 and peak_kib < 256 << 10, (peak_kib, rc, r.stderr[-2000:])
    assert "decoder.layers.mlp.linear_fc2.weight/.zarray" in r.stderr and "chunks" in r.stderr, r.stderr[-2000:]
    assert "decoder.final_layernorm.weight/.zarray: not JSON" in r.stderr, r.stderr[-2000:]
    v = run([ckptfs_bin(), "verify", str(ck), "--index", str(ix)], timeout=300)
    assert v.returncode == 1 and "final_layernorm.weight" in v.stdout, v.stdout[-2000:]
    with mounter(ck, index=ix) as m:
        errors = (m.path / "hf/ERRORS").read_text()
        assert "'decoder.final_layernorm.weight' is not included" in errors, errors
        assert (m.path / "params/decoder.final_layernorm.bias/param.npy").stat().st_size > 0
        np.load(m.path / "params/decoder.final_layernorm.bias/param.npy")
        assert not (m.path / "topo/tp1-pp1").exists()
        assert "final_layernorm.weight" in (m.path / "topo/ERRORS").read_text()


# --- dp_reshardable buckets, damaged -------------------------------------------

DPRESHARD = "dist_dpreshard_tp2_pp2_dp2"
STAGE1 = "decoder.layers.2.mlp.linear_fc1.weight"  # PP stage 1: dp_group_idx_2 (TP 0) and 3 (TP 1)
STAGE0 = "decoder.layers.0.mlp.linear_fc1.weight"


def storage_item(ck, key):
    """(file, offset, length) of one .metadata storage item, via torch's own reader."""
    from torch.distributed.checkpoint import FileSystemReader
    d = ck / "iter_0000007"
    md = FileSystemReader(str(d)).read_metadata()
    return next((d / si.relative_path, si.offset, si.length) for idx, si in md.storage_data.items() if idx.fqn == key)


def read_errno(p):
    try:
        p.read_bytes()
    except OSError as e:
        return e.errno
    return 0


def copy_fixture(megatron_fixtures, tmp_path, scenario=DPRESHARD):
    src = tmp_path / "ck"
    shutil.copytree(megatron_fixtures / scenario, src, ignore=shutil.ignore_patterns(".ckptfs"))
    return src


@pytest.mark.parametrize("scenario", [DPRESHARD, "dist_noargs_dpreshard_tp2_pp2_dp2"])
def test_dp_reshardable_per_bucket_numel_contradicting_the_buffer(megatron_fixtures, mounter, tmp_path, scenario):
    """per_bucket_numel_unpadded of TP 0 / PP 1 rewritten (torch.save, same length)
    to disagree with its bucket tensor: that stage's optimizer states are EIO with
    the reason (log and checkpoint.json), its weights and stage 0's states are served.
    Without args (the layout read from the checkpoint) the check refuses the same
    bucket, and only it."""
    src = copy_fixture(megatron_fixtures, tmp_path, scenario)
    path, off, n = storage_item(src, "optimizer.distributed.dp_group_idx_2.per_bucket_numel_unpadded/shard_0_1")
    data = bytearray(path.read_bytes())
    obj = torch.load(io.BytesIO(bytes(data[off:off + n])), weights_only=False)
    (dtypes, sizes), = obj[0][0].items()
    obj[0][0][dtypes] = [sizes[0] - 64] + sizes[1:]
    buf = io.BytesIO()
    torch.save(obj, buf)
    assert len(buf.getvalue()) == n
    data[off:off + n] = buf.getvalue()
    path.write_bytes(bytes(data))
    ref = reference(src, SCENARIOS[scenario])
    with mounter(src) as m:
        params = m.path / "params"
        assert read_errno(params / STAGE1 / "exp_avg.npy") == errno.EIO
        assert read_errno(params / "decoder.final_layernorm.weight" / "fp32.npy") == errno.EIO
        np.testing.assert_array_equal(np.load(params / STAGE1 / "param.npy"), ref[STAGE1]["param"].float().numpy())
        np.testing.assert_array_equal(np.load(params / STAGE0 / "exp_avg.npy"), ref[STAGE0]["exp_avg"].numpy())
        assert "per_bucket_numel_unpadded [8224] contradicts the bucket tensors [8288]" in m.log_text(), m.log_text()[-2000:]
        findings = json.loads((m.path / "checkpoint.json").read_text())["findings"]
        assert any(f["check"] == "zero-geometry" and "dp_group_idx_2" in f["message"] for f in findings), findings


def test_dp_reshardable_missing_bucket_shard(megatron_fixtures, mounter, tmp_path):
    """.metadata loses one DP shard of bucket 0 of TP 1 / PP 0 (rewritten with torch's
    own Metadata): the states of parameters in that bucket are EIO naming the
    bucket, other buckets' states and all weights are served."""
    src = copy_fixture(megatron_fixtures, tmp_path)
    meta = src / "iter_0000007" / ".metadata"
    import pickle
    md = pickle.loads(meta.read_bytes())
    key = "optimizer.distributed.dp_group_idx_1.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_0.exp_avg"
    gone = [i for i in md.storage_data if i.fqn == key and i.offset[0] > 0][0]
    del md.storage_data[gone]
    meta.write_bytes(pickle.dumps(md))
    ref = reference(src, SCENARIOS[DPRESHARD])
    with mounter(src) as m:
        params = m.path / "params"
        bad = [n for n in ref if read_errno(params / n / "exp_avg.npy") == errno.EIO]
        assert bad and all(n.startswith(("decoder.layers.0.", "decoder.layers.1.", "embedding.")) for n in bad), bad
        vocab = vocab_of(m)
        for n in ref:
            np.testing.assert_array_equal(np.load(params / n / "param.npy"),
                                          as_served(n, ref[n]["param"], vocab).float().numpy())
            np.testing.assert_array_equal(np.load(params / n / "exp_avg_sq.npy"),
                                          as_served(n, ref[n]["exp_avg_sq"], vocab).numpy())
        assert "bucket_idx_0.exp_avg" in m.log_text(), m.log_text()[-2000:]


def test_verify_finds_a_mislaid_master_shard(megatron_fixtures, bin_path, tmp_path):
    """Two equal-sized parameter ranges of a dp_reshardable bucket swap places in
    .metadata (torch's own Metadata, rewritten): the layout still replays, but each
    parameter's fp32 master no longer rounds to its weight; verify says which."""
    src = copy_fixture(megatron_fixtures, tmp_path)
    meta = src / "iter_0000007" / ".metadata"
    import pickle
    md = pickle.loads(meta.read_bytes())
    key = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_0.param"
    a, b = (next(i for i in md.storage_data if i.fqn == key and i.offset[0] == o) for o in (0, 576))
    assert md.storage_data[a].length == md.storage_data[b].length
    md.storage_data[a], md.storage_data[b] = md.storage_data[b], md.storage_data[a]
    meta.write_bytes(pickle.dumps(md))
    rc, rep = verify_json(bin_path, src)
    found = [f for f in rep["findings"] if f["check"] == "master-mismatch"]
    assert rc == 3 and len(found) == 2, rep["findings"]
    # One Adam step from zero-initialised biases: some elements agree by chance.
    assert all(0 < f["detail"]["mismatched"] <= 32 for f in found), found
    assert {f["tensor"] for f in found} == {"decoder.layers.mlp.linear_fc1.bias[1]", "decoder.layers.mlp.linear_fc2.bias[1]"}


# torch_dist/: megatron-core resumes at a new topology, optimizer included.
RESUME_AT = ["--tp", "1", "--pp", "2", "--dp", "2", "--dist-opt", "--bf16"]
RESUME_MOE = ["--ep", "2", "--experts", "4"]  # 4 experts per layer over EP=2, as the MoE sources have


def resume_source(megatron_fixtures, tmp_path, scenario):
    for committed, args in ((VERSIONED_DIR, VERSIONED.get(scenario)), (WRAPPED_DIR, WRAPPED_ARGS)):
        if (committed / scenario).is_dir():
            src = tmp_path / scenario
            shutil.copytree(committed / scenario, src)  # the index goes beside it, not into the repo
            return src, args
    return megatron_fixtures / scenario, SCENARIOS[scenario]


def resume(ckpt, out, moe=False):
    """megatron_torch_dist_resume.py at RESUME_AT (MoE: with RESUME_MOE) from
    `ckpt` (an iter_N/ directory)."""
    sys.path.insert(0, str(FIXTURES))
    from ports import free_port
    for attempt in range(3):
        r = subprocess.run([sys.executable, str(Path(__file__).parent / "megatron_torch_dist_resume.py"),
                            "1", "2", "2", str(free_port()), str(ckpt), str(out)] + (["2", "4"] if moe else []),
                           capture_output=True, text=True, timeout=600)
        # A listener that took the port between choosing and binding it: choose again.
        if r.returncode == 0 or "EADDRINUSE" not in r.stderr:
            return r
    return r


@pytest.mark.parametrize("scenario", ["legacy_distopt_tp2_pp2_dp2", "zarr_tp2_pp2", "dist_tp2_pp2_dp2",
                                      "dist_dpreshard_tp2_pp2_dp2", "dist_dpzero_tp2_pp2_dp2",
                                      "mcore0.14.0-dist_distopt_tp2_pp2_dp2", "bridge-dist_distopt_tp2_dp2",
                                      NEMO2, "legacy_moe_distopt_tp2_pp2_ep2", "dist_moe_tp2_pp2_ep2",
                                      "dist_moe_dpreshard_tp2_pp2_ep2"])
def test_megatron_core_resumes_torch_dist_view_at_a_new_topology(megatron_fixtures, mounter, tmp_path, scenario):
    """megatron-core 0.16 (dist_checkpointing.load with GPTModel's and the
    DistributedOptimizer's sharded state dicts, the layout from common.pt's
    content metadata, as Megatron-LM's load_checkpoint builds them) resumes
    a TP=2 PP=2 run at TP=1 PP=2 DP=2 from torch_dist/: a legacy-format run
    with the distributed optimizer, a zarr one, torch_dist ones in each
    distributed-optimizer layout (fully_reshardable, dp_reshardable: mcore
    0.15+'s default, whose param groups are per-DP-rank objects, and
    dp_zero_gather_scatter), megatron-core 0.14's fully_sharded_model_space
    save, which 0.16 refuses to load by itself, a Megatron-Bridge and a
    NeMo 2 TP=2 DP=2 run (NeMo 2: Lightning's list of its one optimizer,
    global_step for `iteration`), and MoE runs (4 experts per layer over EP=2, legacy and
    torch_dist, fully_reshardable and dp_reshardable, whose chained members
    keep their param groups in per-DP-rank objects of their own: the experts
    stacked by layer and expert, the dense and the expert optimizer chained)
    at TP=1 PP=2 DP=2 EP=2. Every weight, fp32 master and Adam moment mcore then
    holds equals what the source run held (a padded vocabulary: the rows
    mcore's new padding keeps), the step is the checkpoint's, and one more
    optimizer step runs."""
    src, args = resume_source(megatron_fixtures, tmp_path, scenario)
    want = reference(src, args)
    out = tmp_path / "resumed"
    moe = "--experts" in args
    if scenario in VERSIONED:  # the control: megatron-core 0.16 on the 0.14 save itself
        r = resume(src / "iter_0000007", tmp_path / "direct")
        assert r.returncode != 0 and "ShardedTensor.flattened_range is not supported" in r.stderr, r.stderr[-3000:]
    # Legacy and zarr sources: the index built and the views planned first
    # (`ckptfs index --plan-views`), so the mount serves torch_dist/ from its
    # saved plan; the others plan it at their first listing.
    planned = scenario.startswith(("legacy", "zarr"))
    for plan in (src / ".ckptfs" / "index").glob("*.plan"):  # saved by an earlier run on a cached fixture
        plan.unlink()
    if planned:
        r = subprocess.run([ckptfs_bin(), "index", str(src), "--plan-views"], capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0 and "profile-torch_dist.plan" in r.stdout, r.stdout + r.stderr
    with mounter(src / "checkpoints" if scenario == NEMO2 else src) as m:
        view = m.path / "torch_dist"
        it = int((view / "latest_checkpointed_iteration.txt").read_text())
        assert it == 7
        info = json.loads((m.path / "checkpoint.json").read_text())
        assert info["profiles"] == {"torch_dist": {"available": True}}
        ckpt = view / f"iter_{it:07d}"
        assert json.loads((ckpt / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
        assert "Every tensor of the checkpoint is represented." in (ckpt / "README.txt").read_text()
        r = resume(ckpt, out, moe)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
        assert (f"torch_dist/iter_{it:07d}/ as planned before" in m.log_text()) == planned, m.log_text()
    got = reference(out, [args[0]] + RESUME_AT + (RESUME_MOE if moe else []))
    assert set(got) == set(want)
    for name, g in got.items():
        for state in ("param", "fp32", "exp_avg", "exp_avg_sq"):
            w = want[name][state]
            if is_vocabulary(name):  # mcore's padding at TP=1 (56 rows) keeps the source's first rows
                assert g[state].shape[0] < w.shape[0]
                w = w[:g[state].shape[0]]
            assert torch.equal(g[state], w), (scenario, name, state)
    after = json.loads((out / "after.json").read_text())
    assert after["content_metadata"] == {"distrib_optim_sharding_type": "fully_reshardable"}
    assert after["iteration"] == 7
    if scenario not in WRAPPED:  # Megatron-Bridge and NeMo 2 keep a config, no args
        assert (after["args_tp"], after["args_pp"]) == (2, 2 if "--pp" in args else 1)
    assert after["steps_before"] == [1.0]  # the checkpoint's Adam step (the source took one)
    assert after["update_ok"] and after["finite"]


@pytest.mark.parametrize("scenario, why", [
    ("legacy_tp2_pp2", "a param group records no step"),
    ("legacy_names_tp2_pp2", "has no megatron-core sharded key"),
])
def test_torch_dist_view_absent_with_its_reason(megatron_fixtures, mounter, bin_path, scenario, why):
    """A Megatron run the torch_dist/ layout cannot present (a non-distributed
    optimizer without its step in the param groups, legacy module names) has
    no torch_dist/; checkpoint.json and verify say why."""
    with mounter(megatron_fixtures / scenario) as m:
        assert not (m.path / "torch_dist").exists()
        profile = json.loads((m.path / "checkpoint.json").read_text())["profiles"]["torch_dist"]
        assert profile["available"] is False and why in profile["why"], profile
        assert (m.path / "dcp" / ".metadata").exists()  # dcp/ is there regardless
    rc, rep = verify_json(bin_path, megatron_fixtures / scenario)
    assert any(n.startswith("torch_dist/ is not available: ") and why in n for n in rep["notes"]), rep["notes"]

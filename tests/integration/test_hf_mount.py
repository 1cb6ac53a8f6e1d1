"""hf/ as a transformers model directory, from Megatron runs of the Llama
family written by the real megatron-core (tests/fixtures/make_megatron.py
--arch): `AutoModelForCausalLM.from_pretrained(MNT/hf)` loads with no missing,
unexpected or mismatched keys, and its logits equal those of megatron-core's
own GPTModel loaded from params/ (hf_megatron_forward.py). The tensors are
also checked one by one against params/, split here with torch by
megatron-core's QKV layout (attention.py get_query_key_value_tensors: per
query group [q heads | k | v]) and SwiGLU's [gate; up]."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from conftest import FIXTURES, fixture_lock, make_megatron_fixtures, run, run_producer  # noqa: E402
from test_topo_mount import full_tensor, spawn  # noqa: E402

pytestmark = pytest.mark.xdist_group("hf")

# name -> make_megatron.py arguments.
HF_SCENARIOS = {
    "llama_legacy_tp2_pp2": ["legacy", "--tp", "2", "--pp", "2", "--bf16", "--arch", "llama"],
    "llama_dist_tp2_pp2_dp2": ["dist", "--tp", "2", "--pp", "2", "--dp", "2", "--bf16", "--arch", "llama"],
    "qwen2_legacy_tp2": ["legacy", "--tp", "2", "--bf16", "--arch", "qwen2"],
    "qwen3_dist_tp2": ["dist", "--tp", "2", "--bf16", "--arch", "qwen3"],
    "mixtral_legacy_tp2_pp2_ep2": ["legacy", "--tp", "2", "--pp", "2", "--dp", "2", "--ep", "2", "--bf16",
                                   "--arch", "mixtral"],
    "qwen3_moe_dist_ep2": ["dist", "--tp", "1", "--dp", "2", "--ep", "2", "--bf16", "--arch", "qwen3_moe"],
    "neox_legacy_tp2_pp2": ["legacy", "--tp", "2", "--pp", "2", "--bf16", "--arch", "neox"],
    "neox_dist_tp2": ["dist", "--tp", "2", "--bf16", "--arch", "neox"],
    "gpt2_legacy_tp2_pp2": ["legacy", "--tp", "2", "--pp", "2", "--bf16", "--arch", "gpt2"],
    "gpt2_dist_tp2": ["dist", "--tp", "2", "--bf16", "--arch", "gpt2"],
    "gpt_legacy_tp1": ["legacy", "--tp", "1", "--pp", "1"],
}
UNMAPPED = {"gpt_legacy_tp1"}  # LayerNorm + learned positions + GeGLU: no transformers architecture


@pytest.fixture(scope="session")
def hf_fixtures(tmp_path_factory):
    cache = os.environ.get("CKPTFS_FIXTURE_CACHE")
    return make_megatron_fixtures(Path(cache) / "megatron_hf" if cache else tmp_path_factory.mktemp("megatron_hf"),
                                  HF_SCENARIOS)


def hf_tensors(hf):
    idx = json.loads((hf / "model.safetensors.index.json").read_text())
    out = {}
    for f in sorted(set(idx["weight_map"].values())):
        part = load_file(str(hf / f))
        assert all(idx["weight_map"][k] == f for k in part)
        out.update(part)
    assert idx["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in out.values())
    return out


@pytest.mark.parametrize("scenario", [s for s in HF_SCENARIOS if s not in UNMAPPED])
def test_transformers_loads_hf_like_megatron_core(hf_fixtures, mounter, tmp_path, scenario):
    with mounter(hf_fixtures / scenario) as m:
        assert (m.path / "hf" / "ERRORS").read_text() == ""
        spawn("hf_megatron_forward.py", 1, m.path, tmp_path / "logits.pt")
    got = torch.load(tmp_path / "logits.pt")
    assert got["hf"].shape[-1] == 50  # the real vocabulary: Megatron's padding rows are cut


def split_qkv(w, heads, groups, head_dim):
    g = w.reshape(groups, (heads // groups + 2) * head_dim, *w.shape[1:])
    q, k, v = g.split([heads // groups * head_dim, head_dim, head_dim], dim=1)
    return [x.reshape(-1, *w.shape[1:]) for x in (q, k, v)]


@pytest.mark.parametrize("scenario", ["llama_legacy_tp2_pp2", "qwen2_legacy_tp2", "mixtral_legacy_tp2_pp2_ep2",
                                      "qwen3_moe_dist_ep2"])
def test_every_hf_tensor_is_its_megatron_slice(hf_fixtures, mounter, scenario):
    with mounter(hf_fixtures / scenario) as m:
        args = json.loads((m.path / "args.json").read_text())
        cfg = json.loads((m.path / "hf" / "config.json").read_text())
        # Mixtral's sparse MLP is block_sparse_moe.experts.E.w1/w3/w2, Qwen3-MoE's mlp.experts.E.*_proj.
        qwen3_moe = cfg["model_type"] == "qwen3_moe"
        moe_names = (("mlp", "gate_proj", "up_proj", "down_proj") if qwen3_moe else
                     ("block_sparse_moe", "w1", "w3", "w2"))
        got = hf_tensors(m.path / "hf")
        heads, groups, hd = args["num_attention_heads"], args["num_query_groups"], args["kv_channels"]
        assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (heads, groups, hd)
        assert cfg["vocab_size"] == args["vocab_size"] and cfg["intermediate_size"] == args["ffn_hidden_size"]
        assert cfg["torch_dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is False
        want = {}
        for fqn in sorted(p.name for p in (m.path / "params").iterdir()):
            w = full_tensor(m.path, fqn, "param")
            name = fqn.replace("decoder.layers.", "model.layers.")
            if fqn == "embedding.word_embeddings.weight":
                want["model.embed_tokens.weight"] = w[:args["vocab_size"]]
            elif fqn == "output_layer.weight":
                want["lm_head.weight"] = w[:args["vocab_size"]]
            elif fqn == "decoder.final_layernorm.weight":
                want["model.norm.weight"] = w
            elif fqn.endswith(".linear_qkv.layer_norm_weight"):  # torch_dist: TE's fused names
                want[name.replace("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")] = w
            elif fqn.endswith(".linear_fc1.layer_norm_weight"):
                want[name.replace("mlp.linear_fc1.layer_norm_weight", "post_attention_layernorm.weight")] = w
            elif ".linear_qkv." in fqn:
                for proj, x in zip("qkv", split_qkv(w, heads, groups, hd)):
                    want[name.replace("self_attention.linear_qkv", f"self_attn.{proj}_proj")] = x
            elif ".linear_proj." in fqn:
                want[name.replace("self_attention.linear_proj", "self_attn.o_proj")] = w
            elif fqn.endswith("input_layernorm.weight"):
                want[name] = w
            elif fqn.endswith("pre_mlp_layernorm.weight"):
                want[name.replace("pre_mlp_layernorm", "post_attention_layernorm")] = w
            elif "_layernorm." in fqn and ".self_attention." in fqn:  # QK norms
                want[name.replace("self_attention.q_layernorm", "self_attn.q_norm")
                     .replace("self_attention.k_layernorm", "self_attn.k_norm")] = w
            elif ".mlp.router." in fqn:
                want[name.replace("mlp.router", f"{moe_names[0]}.gate")] = w
            elif ".local_experts." in fqn:
                e = name.replace("mlp.experts.local_experts", f"{moe_names[0]}.experts")
                if ".linear_fc1." in fqn:
                    gate, up = w.chunk(2, 0)
                    want[e.replace("linear_fc1", moe_names[1])], want[e.replace("linear_fc1", moe_names[2])] = gate, up
                else:
                    want[e.replace("linear_fc2", moe_names[3])] = w
            elif ".linear_fc1." in fqn:
                gate, up = w.chunk(2, 0)
                want[name.replace("mlp.linear_fc1", "mlp.gate_proj")] = gate
                want[name.replace("mlp.linear_fc1", "mlp.up_proj")] = up
            elif ".linear_fc2." in fqn:
                want[name.replace("mlp.linear_fc2", "mlp.down_proj")] = w
            else:
                raise AssertionError(f"unexpected parameter {fqn}")
        assert sorted(got) == sorted(want)
        for k, w in want.items():
            assert got[k].dtype == w.dtype and torch.equal(got[k], w.contiguous()), k


BRIDGE = Path(__file__).resolve().parents[1] / "data" / "megatron_bridge"
# config.json fields where ckptfs and Megatron-Bridge 0.3.1 differ, and why (docs/views.md: "Compared with Megatron-Bridge").
BRIDGE_ONLY = {
    "bos_token_id", "eos_token_id",  # from the Hugging Face model Bridge is made from; Megatron records none
    "transformers_version",  # save_pretrained's stamp
    # LlamaBridge.megatron_to_hf_config copies TransformerConfig fields LlamaConfig has no use for
    "hidden_dropout", "num_experts_per_tok", "aux_loss_alpha", "scoring_func", "pretraining_tp", "use_qk_norm",
    "partial_rotary_factor", "rope_scaling",
}
CKPTFS_ONLY = {"rope_parameters", "torch_dtype", "ckptfs_source"}  # transformers 5 and 4 spellings; provenance


def test_hf_matches_megatron_bridges_own_export(mounter):
    """Megatron-Bridge 0.3.1's AutoBridge.save_hf_pretrained of a megatron-core
    Llama at TP 2 (tests/data/megatron_bridge, written by
    tests/fixtures/make_bridge_export.py; Bridge is not installed here): every
    hf/ tensor equals Bridge's, except that ckptfs cuts the embedding and
    output to the run's vocab_size where Bridge keeps Megatron's padding rows
    (so transformers refuses Bridge's directory and loads ckptfs's); config.json
    agrees on every field both write, and the fields only one of them writes
    are the documented ones."""
    from transformers import AutoModelForCausalLM
    bridge = BRIDGE / "bridge"
    with mounter(BRIDGE / "megatron") as m:
        hf = m.path / "hf"
        assert (hf / "ERRORS").read_text() == ""
        ours, theirs = json.loads((hf / "config.json").read_text()), json.loads((bridge / "config.json").read_text())
        got, want = hf_tensors(hf), load_file(str(bridge / "model.safetensors"))
        model, info = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32, output_loading_info=True)
        assert not any(v for k, v in info.items() if k != "error_msgs"), info
    vocab = ours["vocab_size"]
    assert vocab == theirs["vocab_size"] == 50
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        if k in ("model.embed_tokens.weight", "lm_head.weight"):
            assert w.shape[0] == 64, k  # Megatron's padded vocabulary (divisible by 8 x TP)
            w = w[:vocab]
        assert got[k].dtype == w.dtype and torch.equal(got[k], w), k
    both = set(ours) & set(theirs)
    assert {k for k in both if ours[k] != theirs[k]} == set(), {k: (ours[k], theirs[k]) for k in both}
    assert set(theirs) - set(ours) == BRIDGE_ONLY
    assert set(ours) - set(theirs) == CKPTFS_ONLY
    with pytest.raises(RuntimeError, match="size mismatch|ignore_mismatched_sizes"):
        AutoModelForCausalLM.from_pretrained(str(bridge), dtype=torch.float32)


# GPT-NeoX names of Megatron's (mcore) parameters; the fused QKV is copied whole.
NEOX_NAMES = [("embedding.word_embeddings.", "gpt_neox.embed_in."), ("output_layer.", "embed_out."),
              ("decoder.final_layernorm.", "gpt_neox.final_layer_norm."), ("decoder.layers.", "gpt_neox.layers."),
              ("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
              ("mlp.linear_fc1.layer_norm_", "post_attention_layernorm."),
              ("self_attention.linear_qkv.", "attention.query_key_value."),
              ("self_attention.linear_proj.", "attention.dense."), ("pre_mlp_layernorm.", "post_attention_layernorm."),
              ("mlp.linear_fc1.", "mlp.dense_h_to_4h."), ("mlp.linear_fc2.", "mlp.dense_4h_to_h.")]


@pytest.mark.parametrize("scenario", ["neox_legacy_tp2_pp2", "neox_dist_tp2"])
def test_megatron_neox_is_gpt_neox_tensor_for_tensor(hf_fixtures, mounter, scenario):
    """RoPE + LayerNorm + GELU MLP + biases, one key-value head per query head:
    GPTNeoXForCausalLM (sequential residual, partial rotary), each tensor the
    merged Megatron tensor under its NeoX name (the vocabulary padding cut),
    the fused QKV as it is (per head [q | k | v] in both)."""
    with mounter(hf_fixtures / scenario) as m:
        args = json.loads((m.path / "args.json").read_text())
        cfg = json.loads((m.path / "hf" / "config.json").read_text())
        assert (m.path / "hf" / "ERRORS").read_text() == ""
        assert cfg["architectures"] == ["GPTNeoXForCausalLM"] and cfg["use_parallel_residual"] is False
        assert cfg["rotary_pct"] == args["rotary_percent"] == 0.5 and cfg["hidden_act"] == "gelu"
        assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.5 and cfg["vocab_size"] == args["vocab_size"]
        got = hf_tensors(m.path / "hf")
        want = {}
        for fqn in sorted(p.name for p in (m.path / "params").iterdir()):
            name = fqn
            for a, b in NEOX_NAMES:
                name = name.replace(a, b)
            w = full_tensor(m.path, fqn, "param")
            want[name] = w[:args["vocab_size"]] if name in ("gpt_neox.embed_in.weight", "embed_out.weight") else w
        assert sorted(got) == sorted(want)
        for k, w in want.items():
            assert got[k].dtype == w.dtype == torch.bfloat16 and torch.equal(got[k], w.contiguous()), k


@pytest.mark.parametrize("scenario", ["gpt2_legacy_tp2_pp2", "gpt2_dist_tp2"])
def test_megatron_gpt2_is_gpt2_with_conv1d_transposes(hf_fixtures, mounter, scenario):
    """Learned absolute positions + LayerNorm + GELU MLP + biases: GPT2LMHeadModel.
    Conv1D weights are the transposes of Megatron's; c_attn regroups the
    fused per-head [q | k | v] rows into [all q | all k | all v] first (its
    bias too). Read through the mount in odd-sized pieces, the transposed
    bytes equal torch's .t() of the merged Megatron tensors."""
    with mounter(hf_fixtures / scenario) as m:
        args = json.loads((m.path / "args.json").read_text())
        cfg = json.loads((m.path / "hf" / "config.json").read_text())
        assert (m.path / "hf" / "ERRORS").read_text() == ""
        assert cfg["architectures"] == ["GPT2LMHeadModel"] and cfg["activation_function"] == "gelu"
        assert (cfg["n_embd"], cfg["n_head"], cfg["n_layer"], cfg["n_inner"]) == (
            args["hidden_size"], args["num_attention_heads"], args["num_layers"], args["ffn_hidden_size"])
        heads, hd = args["num_attention_heads"], args["kv_channels"]
        got = hf_tensors(m.path / "hf")
        want = {}
        for fqn in sorted(p.name for p in (m.path / "params").iterdir()):
            w = full_tensor(m.path, fqn, "param")
            name = fqn.replace("decoder.layers.", "transformer.h.")
            for a, b in [("self_attention.linear_qkv.layer_norm_", "ln_1."), ("mlp.linear_fc1.layer_norm_", "ln_2."),
                         ("input_layernorm.", "ln_1."), ("pre_mlp_layernorm.", "ln_2."),
                         ("self_attention.linear_qkv.", "attn.c_attn."), ("self_attention.linear_proj.", "attn.c_proj."),
                         ("mlp.linear_fc1.", "mlp.c_fc."), ("mlp.linear_fc2.", "mlp.c_proj."),
                         ("decoder.final_layernorm.", "transformer.ln_f."),
                         ("embedding.position_embeddings.", "transformer.wpe.")]:
                name = name.replace(a, b)
            if fqn == "embedding.word_embeddings.weight":
                want["transformer.wte.weight"] = w[:args["vocab_size"]]
            elif fqn == "output_layer.weight":
                want["lm_head.weight"] = w[:args["vocab_size"]]
            elif ".linear_qkv.weight" in fqn or ".linear_qkv.bias" in fqn:
                q, k, v = split_qkv(w, heads, heads, hd)
                fused = torch.cat([q, k, v])
                want[name] = fused.t() if w.dim() == 2 else fused
            elif w.dim() == 2 and fqn.startswith("decoder.layers."):
                want[name] = w.t()
            else:
                want[name] = w
        assert sorted(got) == sorted(want)
        for k, w in want.items():
            assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], w.contiguous()), k
        # The transposed bytes at odd offsets and lengths, straight from the file.
        idx = json.loads((m.path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
        key = "transformer.h.1.attn.c_attn.weight"
        f = m.path / "hf" / idx[key]
        raw = f.read_bytes()
        hlen = int.from_bytes(raw[:8], "little")
        start, end = json.loads(raw[8:8 + hlen])[key]["data_offsets"]
        body = want[key].contiguous().view(torch.uint8).numpy().tobytes()
        with open(f, "rb") as fh:
            for a, n in [(0, 1), (3, 77), (191, 2), (100, 333), (len(body) - 7, 7)]:
                fh.seek(8 + hlen + start + a)
                assert fh.read(n) == body[a:a + n], (a, n)


def test_hf_options(hf_fixtures, mounter, bin_path, tmp_path):
    src = hf_fixtures / "llama_legacy_tp2_pp2"
    with mounter(src, name="base") as m:
        base = hf_tensors(m.path / "hf")
        base_cfg = json.loads((m.path / "hf" / "config.json").read_text())
    # --hf-dtype fp32: every tensor widened, the config says so.
    with mounter(src, name="fp32", extra=["--hf-dtype", "fp32"]) as m:
        wide = hf_tensors(m.path / "hf")
        assert json.loads((m.path / "hf" / "config.json").read_text())["torch_dtype"] == "float32"
        assert sorted(wide) == sorted(base)
        for k in base:
            assert wide[k].dtype == torch.float32 and torch.equal(wide[k], base[k].float()), k
    # --hf-dtype master: the fp32 master weights of the optimizer (Adam stepped
    # them; the bf16 parameters are their rounding).
    with mounter(src, name="master", extra=["-o", "hf_dtype=master"]) as m:
        master = hf_tensors(m.path / "hf")
        assert (m.path / "hf" / "ERRORS").read_text() == ""
        q = "model.layers.0.self_attn.q_proj.weight"
        assert master[q].dtype == torch.float32 and torch.equal(master[q].bfloat16(), base[q])
        assert not torch.equal(master[q], base[q].float())
    # --hf-arch mistral: the same tensors under MistralForCausalLM, and
    # transformers computes the same logits.
    from transformers import AutoModelForCausalLM
    tokens = torch.arange(32).reshape(2, 16) % 50
    logits = {}
    for arch in ["llama", "mistral"]:
        with mounter(src, name=arch, extra=["--hf-arch", arch]) as m:
            cfg = json.loads((m.path / "hf" / "config.json").read_text())
            assert cfg["model_type"] == arch
            model = AutoModelForCausalLM.from_pretrained(str(m.path / "hf"), dtype=torch.float32)
            with torch.no_grad():
                logits[arch] = model(tokens).logits
    assert torch.equal(logits["llama"], logits["mistral"])
    # --hf-arch that the args contradict: no config.json, the reason in ERRORS.
    with mounter(src, name="qwen2", extra=["--hf-arch", "qwen2"]) as m:
        assert not (m.path / "hf" / "config.json").exists()
        errors = (m.path / "hf" / "ERRORS").read_text()
        assert "--hf-arch qwen2 does not fit: the run's args describe a llama model" in errors
    # --hf-config: the user's config.json is the target, served as given
    # (dtype fields set to what the files hold).
    mine = dict(base_cfg, rms_norm_eps=1e-5, bos_token_id=1)
    (tmp_path / "config.json").write_text(json.dumps(mine))
    with mounter(src, name="cfg", extra=["--hf-config", str(tmp_path / "config.json")]) as m:
        assert json.loads((m.path / "hf" / "config.json").read_text()) == mine
    # Bad options are command-line errors.
    for bad in (["--hf-arch", "gptj"], ["--hf-dtype", "int4"], ["--hf-config", str(tmp_path / "none.json")]):
        r = run([bin_path, "ls", str(src), "hf"] + bad)
        assert r.returncode != 0 and ("hf" in r.stderr or "none.json" in r.stderr), (bad, r.stderr)


def test_unrecognised_or_incomplete_runs_say_why(hf_fixtures, mounter, tmp_path):
    # LayerNorm + learned positions: no transformers architecture ckptfs maps.
    with mounter(hf_fixtures / "gpt_legacy_tp1", name="gpt") as m:
        hf = m.path / "hf"
        assert not (hf / "config.json").exists()
        errors = (hf / "ERRORS").read_text()
        assert "position_embedding_type is 'learned_absolute'" in errors and "normalization is 'LayerNorm'" in errors
        assert "decoder.layers.0.self_attention.linear_qkv.weight" in hf_tensors(hf)  # source names, as before
    # A run whose second pipeline stage is lost: the missing layers are named
    # in ERRORS, not left for transformers to initialise at random.
    half = tmp_path / "half"
    shutil.copytree(hf_fixtures / "llama_legacy_tp2_pp2", half, ignore=shutil.ignore_patterns(".ckptfs", "reference"))
    for d in (half / "iter_0000007").glob("mp_rank_*_001"):
        shutil.rmtree(d)
    with mounter(half, name="half_mnt") as m:
        errors = (m.path / "hf" / "ERRORS").read_text()
        for name in ["lm_head.weight", "model.norm.weight", "model.layers.2.self_attn.q_proj.weight",
                     "model.layers.3.mlp.down_proj.weight"]:
            assert f"'{name}' is missing" in errors, name
        assert "model.layers.1.self_attn.q_proj.weight" in hf_tensors(m.path / "hf")


def produced(factory, name, script, args=()):
    """A single-run producer's output under the fixture cache (or a session
    temp dir), made once: `script` writes OUT/reference/logits.pt last."""
    cache = os.environ.get("CKPTFS_FIXTURE_CACHE")
    out = Path(cache) / name if cache else factory.mktemp(name)
    with fixture_lock(out):
        if not (out / "reference" / "logits.pt").exists():
            run_producer([sys.executable, str(FIXTURES / script), str(out)] + list(args), out, os.environ)
    return out


@pytest.fixture(scope="session")
def torchtitan_ck(tmp_path_factory):
    pytest.importorskip("torchtitan")
    return produced(tmp_path_factory, "torchtitan_llama3", "make_torchtitan.py", ["--no-verify"])


@pytest.fixture(scope="session")
def hf_trainer_ck(tmp_path_factory):
    pytest.importorskip("accelerate")
    return produced(tmp_path_factory, "hf_trainer_ds_zero2", "make_hf_trainer.py")


def test_torchtitan_checkpoint_equals_torchtitans_own_to_hf(torchtitan_ck, mounter, bin_path):
    """torchtitan's CheckpointManager writes a Llama 3 DCP step; hf/ with the
    model's config.json (torchtitan records none) equals what torchtitan's own
    Llama3StateDictAdapter.to_hf gives, tensor by tensor (wq/wk RoPE row
    permutation included), and transformers computes torchtitan's logits."""
    out = torchtitan_ck
    step = out / "checkpoint" / "step-10"
    r = run([bin_path, "cat", str(step), "hf/ERRORS"])
    assert "torchtitan records none in its checkpoint" in r.stdout and "pass --hf-config" in r.stdout
    cfg = out / "reference" / "config.json"
    with mounter(step, extra=["--hf-config", str(cfg)]) as m:
        hf = m.path / "hf"
        assert (hf / "ERRORS").read_text() == ""
        got, want = hf_tensors(hf), load_file(str(out / "reference" / "hf_state_dict.safetensors"))
        assert sorted(got) == sorted(want)
        for k in want:
            assert torch.equal(got[k], want[k]), k
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
        tokens = (torch.arange(32).reshape(2, 16) * 7 + 3) % 96
        with torch.no_grad():
            logits = model(tokens).logits
    ref = torch.load(out / "reference" / "logits.pt")
    assert torch.allclose(logits, ref, atol=1e-5, rtol=1e-5), (logits - ref).abs().max()



@pytest.fixture(scope="session", params=["qwen3", "qwen3_moe"])
def torchtitan_qwen3_ck(request, tmp_path_factory):
    pytest.importorskip("torchtitan")
    return request.param, produced(tmp_path_factory, f"torchtitan_{request.param}", "make_torchtitan.py",
                                   ["--model", request.param, "--no-verify"])


def test_torchtitan_qwen3_and_its_moe_equal_torchtitans_own_to_hf(torchtitan_qwen3_ck, mounter):
    """torchtitan's Qwen3 (tied embeddings) and Qwen3-MoE (4 experts, top 2):
    hf/ under Qwen3's config equals Qwen3StateDictAdapter.to_hf tensor by
    tensor: wq / wk copied (Qwen3's RoPE rotates halves; Llama 3's is
    permuted), each GroupedExperts weight [E, ...] split into E expert
    tensors; the load-balancing expert_bias_E is named in ERRORS, not
    silently dropped. transformers loads it with no missing or unexpected
    keys, and its logits are torchtitan's (MoE: within the bf16 rounding of
    torchtitan's grouped experts)."""
    model_name, out = torchtitan_qwen3_ck
    moe = model_name == "qwen3_moe"
    step = out / "checkpoint" / "step-10"
    with mounter(step, name=model_name, extra=["--hf-config", str(out / "reference" / "config.json")]) as m:
        hf = m.path / "hf"
        errors = (hf / "ERRORS").read_text()
        if moe:
            lines = errors.splitlines()
            assert len(lines) == 2 and all("moe.expert_bias_E' is not included: torchtitan's load-balancing bias"
                                           in e for e in lines), errors
        else:
            assert errors == ""
        cfg = json.loads((hf / "config.json").read_text())
        assert cfg["architectures"] == ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"]
        got, want = hf_tensors(hf), load_file(str(out / "reference" / "hf_state_dict.safetensors"))
        assert sorted(got) == sorted(want)
        for k in want:
            assert torch.equal(got[k], want[k]), k
        if moe:
            assert "model.layers.1.mlp.experts.3.down_proj.weight" in got
        from transformers import AutoModelForCausalLM
        model, info = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32, output_loading_info=True)
        assert not any(v for k, v in info.items() if k != "error_msgs"), info
        tokens = (torch.arange(32).reshape(2, 16) * 7 + 3) % 96
        with torch.no_grad():
            logits = model(tokens).logits
    ref = torch.load(out / "reference" / "logits.pt")
    # make_torchtitan.py: torchtitan's grouped experts run in bfloat16.
    assert torch.allclose(logits, ref, atol=2e-4 if moe else 1e-5, rtol=0), (logits - ref).abs().max()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_torchtitan_fp32_narrowed_like_torchtitans_export_dtype(torchtitan_ck, mounter, dtype):
    """torchtitan trains and saves float32; its convert_to_hf --export_dtype
    bfloat16 / float16 casts every to_hf tensor with torch's .to(). hf/ with
    --hf-dtype bf16 / fp16 serves the same bytes, rounded by the daemon
    straight from the mapped shards (round to nearest even, ties to even),
    and transformers loads it in that dtype with the float32 model's logits
    to within that dtype's rounding."""
    out = torchtitan_ck
    step = out / "checkpoint" / "step-10"
    td = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    with mounter(step, name=dtype, extra=["--hf-config", str(out / "reference" / "config.json"),
                                          "--hf-dtype", dtype]) as m:
        hf = m.path / "hf"
        assert (hf / "ERRORS").read_text() == ""
        cfg = json.loads((hf / "config.json").read_text())
        assert cfg["torch_dtype"] == cfg["dtype"] == str(td).removeprefix("torch.")
        got, want = hf_tensors(hf), load_file(str(out / "reference" / "hf_state_dict.safetensors"))
        assert sorted(got) == sorted(want)
        ties = 0
        for k, w in want.items():
            assert w.dtype == torch.float32 and got[k].dtype == td, k
            assert torch.equal(got[k], w.to(td)), k
            # Values whose dropped bits are exactly half an ulp: the tie rule decides them.
            drop = 16 if dtype == "bf16" else 13
            ties += int(((w.view(torch.int32) & ((1 << drop) - 1)) == (1 << (drop - 1))).sum())
        # Narrowed by the daemon straight from the mapped shards.
        assert json.loads((m.path / ".ckptfs" / "stats").read_text())["mapped_conversions"] > 0
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=td)
        assert next(model.parameters()).dtype == td
        tokens = (torch.arange(32).reshape(2, 16) * 7 + 3) % 96
        with torch.no_grad():
            logits = model(tokens).logits.float()
    ref = torch.load(out / "reference" / "logits.pt")
    err = (logits - ref).abs().max() / ref.abs().max()
    assert err < (3e-2 if dtype == "bf16" else 4e-3), err
    print(f"{dtype}: {ties} ties among the tensors, logits relative error {float(err):.2e}")


@pytest.fixture(scope="session")
def hf_fsdp_dcp_ck(tmp_path_factory):
    pytest.importorskip("accelerate")
    return produced(tmp_path_factory, "accelerate_hf_llama", "make_accelerate.py", ["--hf-llama"])


def test_dcp_of_a_hugging_face_model_from_accelerate_fsdp2(hf_fsdp_dcp_ck, mounter, bin_path):
    """A transformers Llama trained a step under FSDP2 and saved as the Trainer
    saves it with SHARDED_STATE_DICT (accelerate's save_fsdp_model /
    save_fsdp_optimizer: DCP at world 2, Hugging Face names): the Trainer keeps
    no config.json in checkpoint-N/, so hf/ERRORS asks for one; with
    --hf-config the model's own config.json, every hf/ tensor is the trained
    model's (get_state_dict full), and transformers computes its logits."""
    out = hf_fsdp_dcp_ck
    ck = out / "checkpoint-1"
    r = run([bin_path, "cat", str(ck), "hf/ERRORS"])
    assert "pass --hf-config FILE" in r.stdout, r.stdout
    with mounter(ck, extra=["--hf-config", str(out / "config.json")]) as m:
        hf = m.path / "hf"
        assert (hf / "ERRORS").read_text() == ""
        assert json.loads((hf / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
        got, want = hf_tensors(hf), load_file(str(out / "reference" / "model.safetensors"))
        assert sorted(got) == sorted(want)
        for k in want:
            assert torch.equal(got[k], want[k]), k
        # The optimizer states of the same save sit under their parameters.
        assert (m.path / "params" / "model.layers.0.self_attn.q_proj.weight" / "exp_avg.raw").exists()
        from transformers import AutoModelForCausalLM
        model, info = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32, output_loading_info=True)
        assert not any(v for k, v in info.items() if k != "error_msgs"), info
        with torch.no_grad():
            logits = model((torch.arange(32).reshape(2, 16) * 7 + 3) % 96).logits
    assert torch.equal(logits, torch.load(out / "reference" / "logits.pt"))


def test_hf_trainer_deepspeed_checkpoint(hf_trainer_ck, mounter):
    """The HF Trainer with DeepSpeed ZeRO-2 (DP=2, CPU) saves checkpoint-N/:
    mounted, hf/ is its ZeRO shards under their own (Hugging Face) names with
    the config.json and generation_config.json beside them; every tensor equals
    the Trainer's own save_pretrained (checkpoint-N/model.safetensors) and
    transformers computes the trained model's logits."""
    out = hf_trainer_ck
    ck = out / "checkpoint-3"
    assert (ck / "global_step3").is_dir()
    with mounter(ck) as m:
        hf = m.path / "hf"
        assert (hf / "ERRORS").read_text() == ""
        assert (hf / "generation_config.json").read_bytes() == (ck / "generation_config.json").read_bytes()
        src_cfg = json.loads((ck / "config.json").read_text())
        assert json.loads((hf / "config.json").read_text()) == dict(src_cfg, torch_dtype="float32", dtype="float32")
        got, want = hf_tensors(hf), load_file(str(ck / "model.safetensors"))
        assert sorted(got) == sorted(want)
        for k in want:
            assert torch.equal(got[k], want[k]), k
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
        with torch.no_grad():
            logits = model((torch.arange(32).reshape(2, 16) * 7 + 3) % 96).logits
    assert torch.allclose(logits, torch.load(out / "reference" / "logits.pt"), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("world,loader", [(3, "accelerate"), (3, "fabric")])
def test_hf_trainer_moves_from_deepspeed_to_fsdp2_with_its_optimizer(world, loader, hf_trainer_ck, mounter, tmp_path):
    """DeepSpeed -> FSDP without losing Adam: the HF Trainer's DeepSpeed ZeRO-2
    run (DP=2) resumes under FSDP2 on 3 ranks through Accelerate's own loaders
    (load_fsdp_model / load_fsdp_optimizer, what Accelerator.load_state calls)
    pointed at the mount's accelerate/, and through Lightning Fabric's
    fabric.load pointed at its dcp/. The weights are DeepSpeed's fp32
    masters (zero_to_fp32's), the Adam moments and steps DeepSpeed's, the
    Trainer's two param groups come back with their FQNs and hyperparameters
    (the scheduler's lr included), and the next step's loss equals one taken
    in memory by a plain AdamW given the same states (and not one from fresh
    moments)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    sys.path.insert(0, str(FIXTURES))
    from hf_trainer_fsdp_resume_worker import next_loss, trainer_groups
    from make_hf_trainer import config
    from transformers import LlamaForCausalLM

    ck = hf_trainer_ck / "checkpoint-3"
    masters = get_fp32_state_dict_from_zero_checkpoint(str(ck), tag="global_step3")
    optim_file = torch.load(ck / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    ds_groups = optim_file["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]
    out = tmp_path / "restored.pt"
    with mounter(ck, index=tmp_path / "ix") as m:
        states = {fqn: {s: torch.from_numpy(__import__("numpy").load(m.path / "params" / fqn / f"{s}.npy"))
                        for s in ("exp_avg", "exp_avg_sq", "step")} for fqn in masters}
        src = m.path / ("accelerate" if loader == "accelerate" else "dcp")
        r = subprocess.run([sys.executable, str(FIXTURES / "hf_trainer_fsdp_resume_worker.py"), str(src), str(out),
                            str(world), loader], capture_output=True, text=True, timeout=600, cwd=str(FIXTURES),
                           env=dict(os.environ, PYTHONWARNINGS="ignore"))
        assert r.returncode == 0, r.stderr[-4000:]
    got = torch.load(out, weights_only=False)
    assert set(got["model"]) == set(masters)
    for fqn, w in masters.items():
        assert torch.equal(got["model"][fqn], w), fqn
        for s in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["optim"][fqn][s], states[fqn][s]), (fqn, s)
        assert float(got["optim"][fqn]["step"]) == float(states[fqn]["step"]) == 3.0, fqn
    assert len(got["groups"]) == len(ds_groups) == 2
    for mine, theirs in zip(got["groups"], ds_groups):
        for k in ("lr", "betas", "eps", "weight_decay", "amsgrad"):
            assert mine[k] == theirs[k], k
    assert got["groups"][0]["lr"] != 5e-2  # the worker's own lr was replaced by the Trainer's scheduled one
    # The reference: the same model and states in one process, a plain AdamW.
    model = LlamaForCausalLM(config())
    model.load_state_dict(masters)
    optim = torch.optim.AdamW(trainer_groups(model), lr=5e-2)
    names = {p: n for n, p in model.named_parameters()}
    for g, theirs in zip(optim.param_groups, ds_groups):
        g.update({k: v for k, v in theirs.items() if k != "params"})
        for p in g["params"]:
            optim.state[p] = {s: states[names[p]][s].clone() for s in ("exp_avg", "exp_avg_sq", "step")}
    assert got["group_params"] == [[names[p] for p in g["params"]] for g in optim.param_groups]
    want = next_loss(model, optim)
    assert torch.allclose(got["loss"], want, rtol=1e-6, atol=0), (float(got["loss"]), float(want))
    # The control: the same step from fresh moments gives another loss.
    fresh = LlamaForCausalLM(config())
    fresh.load_state_dict(masters)
    control = next_loss(fresh, torch.optim.AdamW(trainer_groups(fresh), lr=5e-2))
    assert not torch.allclose(control, want, rtol=1e-4, atol=0), (float(control), float(want))

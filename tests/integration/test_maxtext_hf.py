"""hf/ of MaxText checkpoints, against MaxText's own forward pass and converter.

tests/data/orbax_maxtext/ holds checkpoints written by maxtext 0.2.5's own
trainer (Llama 2 scanned and unscanned, Llama 3.1, Mistral, Gemma 2), the
logits MaxText's forward pass computed from each, and the Hugging Face
directory MaxText's to_huggingface wrote (or, where 0.2.5 has no converter for
the model, MAPPING.md's mapping applied in numpy); see its README.md. MaxText
saves no model config, so each mount gets --hf-config (the model's config.json)
and, for the Llama 3.1 config, --hf-rope interleaved. For each:

* every tensor of the mount's hf/ equals the reference directory's, bit for bit
  (q_proj scaled by sqrt(head_dim), RoPE rows reordered for Llama 3.1, Gemma's
  norms - 1 and embedding / sqrt(hidden), one MaxText Gemma 2 layer as two
  Hugging Face layers, scanned stacks sliced per layer);
* transformers loads MNT/hf with no missing or unexpected keys, and its logits
  on tokens.npy equal MaxText's logits.npy (to 2e-5; Gemma 2 with the bfloat16
  copy of the tied embedding MaxText's attend_on_embedding computes with, as
  the README records; the float32 model is 7.3e-3 away);
* --hf-dtype bf16 rounds the scaled q_proj once (it equals the float32 tensor
  narrowed: the scale, 4, is exact);
* what the checkpoint cannot say is asked for, never guessed: no --hf-config,
  a Llama 3.x config without --hf-rope, a config of the wrong size or a Gemma 2
  config whose query_pre_attn_scalar is not head_dim leave hf/ unmapped with
  the reason in hf/ERRORS.
"""
import json
import shutil

import numpy as np
import pytest

from conftest import ROOT, ckptfs_bin, run

DATA = ROOT / "tests" / "data" / "orbax_maxtext"
# variant: (reference directory, extra options)
VARIANTS = {
    "llama_tiny": ("hf_from_mapping", []),
    "llama_unscanned": ("hf_from_mapping", []),
    "llama31_tiny": ("hf_reference", ["--hf-rope", "interleaved"]),
    "mistral_tiny": ("hf_from_mapping", []),
    "gemma_tiny": ("hf_reference", []),
}


@pytest.fixture(scope="session")
def copies(tmp_path_factory):
    """The committed checkpoints copied (ckptfs writes its index into them)."""
    root = tmp_path_factory.mktemp("maxtext")
    for v in VARIANTS:
        shutil.copytree(DATA / v / "checkpoints", root / v)
    return root


def options(variant, **over):
    ref, extra = VARIANTS[variant]
    cfg = over.get("config", DATA / variant / ref / "config.json")
    return (["--hf-config", str(cfg)] if cfg else []) + over.get("extra", extra)


def hf_files(hf):
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(hf.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_equals_maxtext_converter_and_forward_pass(variant, copies, mounter):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ref_dir = DATA / variant / VARIANTS[variant][0]
    ref = hf_files(ref_dir)
    with mounter(copies / variant, extra=options(variant)) as m:
        hf = m.path / "hf"
        assert (hf / "ERRORS").read_text() == ""
        got = hf_files(hf)
        assert sorted(got) == sorted(ref)
        for k, want in ref.items():
            assert got[k].shape == want.shape and got[k].dtype == want.dtype, k
            assert np.array_equal(got[k].view(np.uint32), want.view(np.uint32)), k
        assert json.loads((hf / "config.json").read_text())["model_type"] == json.loads(
            (ref_dir / "config.json").read_text())["model_type"]

        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(hf), dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        model.eval()
        if variant == "gemma_tiny":
            # MaxText's tied logits use a bfloat16 copy of the embedding.
            emb = model.get_input_embeddings().weight.detach()
            model.lm_head = torch.nn.Linear(emb.shape[1], emb.shape[0], bias=False)
            model.lm_head.weight = torch.nn.Parameter(emb.to(torch.bfloat16).to(torch.float32))
        tokens = torch.from_numpy(np.load(DATA / variant / "tokens.npy").astype(np.int64))
        with torch.no_grad():
            logits = model(tokens).logits.numpy()
        want = np.load(DATA / variant / "logits.npy")
        assert np.abs(logits - want).max() < 2e-5
        assert (logits.argmax(-1) == want.argmax(-1)).all()
        del model


def test_bf16_q_proj_is_rounded_once(copies, mounter):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    ref = load_file(str(DATA / "llama31_tiny" / "hf_reference" / "model.safetensors"))
    with mounter(copies / "llama31_tiny", extra=options("llama31_tiny") + ["--hf-dtype", "bf16"]) as m:
        got = {}
        for f in sorted((m.path / "hf").glob("*.safetensors")):
            got.update(load_file(str(f)))
    for k in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
              "model.embed_tokens.weight"):
        assert got[k].dtype == torch.bfloat16
        assert torch.equal(got[k].view(torch.int16), ref[k].to(torch.bfloat16).view(torch.int16)), k


def errors(src, *extra):
    r = run([ckptfs_bin(), "cat", str(src), "hf/ERRORS", *extra])
    assert r.returncode == 0, r.stderr
    listing = run([ckptfs_bin(), "ls", str(src), "hf", *extra])
    return r.stdout, listing.stdout


def test_without_config_hf_says_what_to_pass(copies):
    text, listing = errors(copies / "llama_tiny")
    assert "MaxText saves no model config" in text and "--hf-config" in text
    assert "config.json" not in listing


def test_llama3_config_needs_hf_rope(copies):
    text, listing = errors(copies / "llama31_tiny", *options("llama31_tiny", extra=[]))
    assert "--hf-rope interleaved or --hf-rope halves" in text and "model_name" in text
    assert "config.json" not in listing
    # Told halves, it maps (and the logits test above shows interleaved is right).
    text, listing = errors(copies / "llama31_tiny", *options("llama31_tiny", extra=["--hf-rope", "halves"]))
    assert text == "" and "config.json" in listing


def test_config_of_another_size_is_refused_naming_the_key(copies, tmp_path):
    cfg = json.loads((DATA / "mistral_tiny" / "hf_from_mapping" / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    cfg["intermediate_size"] = 256
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    text, listing = errors(copies / "mistral_tiny", "--hf-config", str(p))
    assert "num_hidden_layers is 3, the checkpoint's 2" in text
    assert "intermediate_size is 256, the checkpoint's 128" in text
    assert "config.json" not in listing


def test_gemma2_query_pre_attn_scalar_must_be_head_dim(copies, tmp_path):
    cfg = json.loads((DATA / "gemma_tiny" / "hf_reference" / "config.json").read_text())
    cfg["query_pre_attn_scalar"] = 256  # what MaxText's converter wrote for the shrunk model
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    text, _ = errors(copies / "gemma_tiny", "--hf-config", str(p))
    assert "query_pre_attn_scalar is 256" in text and "head_dim (16)" in text
    # A Llama config on Gemma's tensors is refused too.
    text, _ = errors(copies / "gemma_tiny", "--hf-config",
                     str(DATA / "llama_tiny" / "hf_from_mapping" / "config.json"))
    assert "lacks MaxText's embedding, query, key or MLP kernels" in text

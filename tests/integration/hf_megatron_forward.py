"""transformers loads a mount's hf/ and agrees with megatron-core's own forward.

One gloo process: a megatron-core GPTModel at TP=1, PP=1 with the run's config
(MNT/args.json: the fixture's Llama-family, GPT-NeoX or GPT-2 args) is loaded from
MNT/params/<fqn>/param.raw (every parameter; torch_dist's norm names are
Transformer Engine's), and `AutoModelForCausalLM.from_pretrained(MNT/hf)`
loads the Hugging Face view. Both run in float32 on the same tokens; the
script fails unless transformers reports no missing, unexpected or mismatched
keys and the logits over the real vocabulary agree. OUT gets both logits.

    python hf_megatron_forward.py 1 PORT MNT OUT
"""
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist

import make_megatron as mk  # tests/fixtures: the producer's CPU shims


def mcore_logits(mnt, args, tokens):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.transformer_config import TransformerConfig
    ps.initialize_model_parallel(1, 1)
    tp_random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    pos_type = args["position_embedding_type"]  # rope, or learned_absolute (GPT-2)
    rope = dict(rotary_base=args["rotary_base"], rotary_percent=args.get("rotary_percent", 1.0)) if pos_type == "rope" else {}
    # SwiGLU (the Llama family) or mcore's default exact GELU (GPT-NeoX, GPT-2).
    act = torch.nn.functional.silu if args["swiglu"] else torch.nn.functional.gelu
    experts = args.get("num_experts")
    moe = dict(num_moe_experts=experts, moe_router_topk=args["moe_router_topk"], moe_grouped_gemm=False) if experts else {}
    cfg = TransformerConfig(
        num_layers=args["num_layers"], hidden_size=args["hidden_size"], num_attention_heads=args["num_attention_heads"],
        num_query_groups=args["num_query_groups"], kv_channels=args["kv_channels"],
        ffn_hidden_size=args["ffn_hidden_size"], gated_linear_unit=args["swiglu"], add_bias_linear=args["add_bias_linear"],
        add_qkv_bias=args["add_qkv_bias"], qk_layernorm=args["qk_layernorm"], normalization=args["normalization"],
        layernorm_epsilon=args["norm_epsilon"], activation_func=act, use_cpu_initialization=True, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, **moe)
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, qk_layernorm=args["qk_layernorm"],
                                    normalization=args["normalization"])
    torch.manual_seed(999)  # every weight is loaded below
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=args["padded_vocab_size"],
                     max_sequence_length=args["max_position_embeddings"], position_embedding_type=pos_type, **rope,
                     share_embeddings_and_output_weights=False, parallel_output=False)
    sd = {}
    for k, v in model.state_dict().items():
        if not torch.is_tensor(v) or k.endswith("_extra_state"):
            continue
        d = os.path.join(mnt, "params", k)
        if not os.path.isdir(d):  # torch_dist: the local spec's sharded_state_dict_keys_map (TE's names)
            for a, b in [("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
                         ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")]:
                d = d.replace(a, b)
        info = json.load(open(os.path.join(d, "info.json")))["tensors"]["param"]
        raw = open(os.path.join(d, "param.raw"), "rb").read()
        shape = info["shape"]
        if "vocab_padding" in info:  # params/ has the true vocabulary; Megatron's model the padded one
            raw += open(os.path.join(d, "param.vocab_padding.raw"), "rb").read()
            shape = info["vocab_padding"]["stored_shape"]
        t = torch.frombuffer(bytearray(raw), dtype=getattr(torch, info["dtype"])).reshape(shape)
        sd[k] = t.float()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not [m for m in missing if not m.endswith("_extra_state")] and not unexpected, (missing, unexpected)
    model.eval()
    s = tokens.shape[1]
    pos = torch.arange(s).unsqueeze(0).expand(tokens.shape[0], s)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        return model(tokens, pos, mask)[:, :, :args["vocab_size"]].float()


def hf_logits(mnt, tokens):
    from transformers import AutoModelForCausalLM
    model, info = AutoModelForCausalLM.from_pretrained(os.path.join(mnt, "hf"), dtype=torch.float32,
                                                       output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    assert not bad, bad
    model.eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def main():
    port, mnt, out = sys.argv[2], sys.argv[3], sys.argv[4]
    args = json.load(open(os.path.join(mnt, "args.json")))
    s = args["max_position_embeddings"]
    tokens = (torch.arange(2 * s).reshape(2, s) * 7 + 3) % args["vocab_size"]
    # transformers first: the producer's CPU shims wrap torch.arange & co, which
    # leaves transformers' RoPE buffers uninitialised.
    got = hf_logits(mnt, tokens)
    mk.cpu_only()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    ref = mcore_logits(mnt, args, tokens)
    torch.save({"mcore": ref, "hf": got}, out)
    diff = (ref - got).abs().max().item()
    print(f"max |mcore - transformers| = {diff:.3g} over logits of max {ref.abs().max().item():.3g}")
    assert ref.abs().max() > 0 and torch.allclose(got, ref, atol=1e-5, rtol=1e-4), diff
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

r"""DeepSpeed checkpoints with the metadata scale of huge runs and tiny tensors (issue 18).

ckptfs builds its index from metadata only, so what costs at scale is the number of rank files,
parameters and fragments, not tensor bytes. This writes checkpoints with a real run's file and
fragment counts whose tensors are a few KiB per rank, for `ckptfs index` / `mount` benchmarks.

    python bench/scale/make_deepspeed_scale.py OUT [--layout zero] [--dp 768] [--stage 2]
        [--layers 70] [--hidden 80] [--ffn 160] [--ref REF.npz] [--template DIR]
    python bench/scale/make_deepspeed_scale.py OUT --layout bloom [--pp 12] [--tp 4] [--dp 8]
        [--layers 70] [--ref REF.npz] [--template DIR]

What is real and what is re-partitioned
  1. A REAL save by the real engine, on CPU with gloo (tests/fixtures/make_deepspeed.py for
     `zero`: DeepSpeedZeroOptimizer at DP=2 with the requested stage, its `gpt` model scaled by
     --layers/--hidden/--ffn; tests/fixtures/make_deepspeed_pipe.py for `bloom`: PipelineEngine,
     fp32 ZeRO-1, PP=1 x TP x DP=1 with --layers transformer layers). Kept under --template DIR
     (reused when it already holds a save) or a temporary directory.
  2. Its files are torch.load-ed as templates: every key, value, dtype and pickled object
     (loss scaler, ZeroStageEnum, fragment_address, param_groups, ds_config, client state) comes
     from the engine. The full flat fp32 group and Adam exp_avg / exp_avg_sq of every param
     group are rebuilt by concatenating the ranks' partitions.
  3. Those flat groups are re-partitioned for the target degree with the engine's own geometry
     (deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.__init__ at DeepSpeed 0.19.8):
     the per-parameter alignment paddings the template recorded, `align_dense_tensors` to a
     multiple of nccl_start_alignment_factor (2) x DP, equal partitions (get_data_parallel_partitions
     on a multiple of DP), the `groups_padding` rule (a rank whose partition lies wholly in the
     padding has padding = its whole partition: at DP=768 with tiny groups the padding spans
     several ranks, what README's `zero-geometry` check is about), `single_partition_of_fp32_groups`
     lean (padding stripped, as state_dict() does), base_optimizer_state.state[g] exp_avg /
     exp_avg_sq full partitions (elastic_checkpoint is off by default, so the engine pickles the
     torch optimizer's own state_dict, padding included, zero there as the engine's Adam leaves
     it), `param_slice_mappings` from DeepSpeed's own _init_lp_to_hp_mapping +
     get_hp_fragment_mapping on meta tensors, `partition_count` = [DP] * groups, and in the model
     states `dp_world_size` (and for `bloom` `mp_world_size`, `checkpoint_parallel_dimensions`,
     the Megatron `args` degrees, each stage's `param_shapes`), `global_samples` and
     ds_config's train_batch_size scaled to the target DP.
     For `bloom` the pipeline stages are PipelineModule's own partition_balanced over the
     `type:transformer` weights (as _partition_layers does); a stage's flat groups hold its own
     parameters in named_parameters order (tied embedding first, on the first and the last
     stage); the layer_XX-model_TT-model_states.pt files do not depend on PP or DP and are the
     engine's own files, copied byte for byte.
  Nothing is trained at the target degree: the values are the template's (DP-independent for a
  ZeRO-1/2 run in exact arithmetic, identical here by construction), so a reader that merges the
  target files must reproduce the template's full tensors exactly.

Layouts
  zero   global_step2/zero_pp_rank_{r}_mp_rank_00_optim_states.pt, r in 0..DP-1,
         mp_rank_00_model_states.pt, latest. Defaults: DP=768, stage 2, 70 layers of the
         fixture's GPT (hidden 80, ffn 160): 844 parameters (843 trainable) in 2 groups; the
         group paddings (1024 and 768 elements) fall on the last rank and over the last 8 ranks.
  bloom  BLOOM-176B's layout at PP=12 x TP=4 x DP=8 by default (the fixture's PipelineEngine
         model, hidden 8, ffn 8 (--ffn must divide by TP), 70 transformer layers):
         global_step2/layer_XX-model_TT-model_states.pt (72 per TP rank),
         mp_rank_MM_model_states.pt (MM = pp*TP + tp), zero_pp_rank_D_mp_rank_MM_optim_states.pt.

--ref REF.npz: keys are paths under a ckptfs mount root (`params/<name>/fp32.npy`,
`exp_avg.npy`, `exp_avg_sq.npy`, `param.npy`), values the exact arrays a correct reader serves,
for about --ref-count parameters (zero: first and last of each group -- the last one borders the
padding --, ones a rank boundary cuts, then evenly spaced ones; bloom: the tied embedding, the
final norm and one parameter of every TP merge rule from the first, middle and last layers).
They are the template's full tensors (fp32 master and Adam states from the flat groups, the
model copy from the module / layer files), merged over TP by ds_to_universal.py's rules and cut
to universal_checkpoint_info's original_vocab_size, and the script checks them against the
template engine's own safe_get_full_fp32_param / safe_get_full_optimizer_state references.

Checked by hand (not in CI):
  - against real saves at a small target degree: the files generated for `--dp 4 --stage 1
    --layers 3 --hidden 8 --ffn 6`, `--dp 4 --model padspan` (padding over two ranks) and
    `--layout bloom --pp 2 --tp 2 --dp 2 --layers 4 --ffn 6` have the same names, pickled
    structure, non-tensor values (paddings, param_slice_mappings, partition counts, param_shapes,
    args, ...) and tensor dtypes/shapes/requires_grad as the engine's own save at that degree
    (make_deepspeed.py --dp 4 / make_deepspeed_pipe.py --pp 2 --tp 2 --dp 2); only values differ,
    as the data each DP rank trains on differs;
  - DeepSpeed's own ds_to_universal.py (strict) converts the zero output at DP=768 and the bloom
    output; its universal/zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt equal the REF arrays, and at
    DP=768 every file of a ckptfs mount's universal/ is torch.load-equal to its output;
  - `ckptfs index`, `info`, `verify` (clean) and a mount serving every REF array exactly, for zero
    stage 1 and 2 at DP=768 (also 1536, 3072) and for bloom.
Generation takes 1-3 min on 2 busy cores (the template run is most of it; the rank files' cost is
DP x parameters: 35 s at DP=768 x 843 params, 2 min at 768 x 3363), 75 MiB (zero, DP=768) and
5 MiB (bloom).

Versions: written against DeepSpeed 0.19.8 / torch 2.15 (CPU); the template must come from the
same deepspeed that is imported here (the script checks ds_version). make_deepspeed_pipe.py got
`--ffn` for this (its default MLP width 6 does not divide by TP=4).
"""
import argparse
import collections
import copy
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("DS_BUILD_OPS", "0")

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
sys.path.insert(0, FIXTURES)

NCCL_START_ALIGNMENT_FACTOR = 2  # DeepSpeedZeroOptimizer.nccl_start_alignment_factor (0.19.8)


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


# ----------------------------------------------------------------------------- engine geometry
class Group:
    """One ZeRO param group's flat layout at a given DP, computed as DeepSpeedZeroOptimizer
    does (stage_1_and_2.py __init__, _link_all_hp_params, state_dict)."""

    def __init__(self, names, shapes, param_padding, dp):
        from deepspeed.runtime.utils import align_dense_tensors
        self.names, self.shapes, self.dp = list(names), list(shapes), dp
        self.param_padding = list(param_padding)
        self.meta = [torch.empty(s, device="meta") for s in shapes]
        self.offsets, off = [], 0
        for m, pad in zip(self.meta, self.param_padding):
            self.offsets.append(off)
            off += m.numel() + pad
        self.padded_group_numel = off  # real elements plus per-parameter alignment padding
        alignment = NCCL_START_ALIGNMENT_FACTOR * dp
        tensors = []
        for m, pad in zip(self.meta, self.param_padding):
            tensors.append(m.flatten())
            if pad:
                tensors.append(torch.empty(pad, device="meta"))
        self.total = sum(t.numel() for t in align_dense_tensors(tensors, alignment))
        assert self.total % dp == 0
        # get_data_parallel_partitions: base_size = total // dp, the remainder is 0 here
        self.partition_size = self.total // dp

    def padding(self, r):
        """groups_padding for partition r (stage_1_and_2.py, 'Record padding required for alignment')."""
        left, size = r * self.partition_size, self.partition_size
        if self.padded_group_numel <= left:
            return size
        if self.padded_group_numel < left + size:
            return left + size - self.padded_group_numel
        return 0

    def slice_mappings(self, r):
        """param_slice_mappings[g] of rank r: DeepSpeed's own _init_lp_to_hp_mapping and
        get_hp_fragment_mapping over meta tensors (the engine's _create_param_mapping keeps the
        params with an _hp_mapping, in bit16 group order)."""
        from deepspeed.utils.mixed_precision_linkage import _init_lp_to_hp_mapping
        from deepspeed.utils.tensor_fragment import get_hp_fragment_mapping
        start, size = r * self.partition_size, self.partition_size
        param_offsets = self.offsets if any(self.param_padding) else None
        flat_hp = torch.empty(size, device="meta")
        lps = [m.clone() for m in self.meta]
        out = collections.OrderedDict()
        found = {}
        for lp, lp_start in _init_lp_to_hp_mapping(lps, start, size, None, param_offsets):
            found[id(lp)] = get_hp_fragment_mapping(lp, lp_start, flat_hp, {}, {}, False, 0, start, size)
        for lp, name in zip(lps, self.names):
            if id(lp) in found:
                out[name] = found[id(lp)].get_hp_fragment_address()
        return out


def full_flat(group, values):
    """The flat group (padded to group.total) holding `values` (name -> tensor) at their offsets."""
    flat = torch.zeros(group.total, dtype=torch.float32)
    for name, off, shape in zip(group.names, group.offsets, group.shapes):
        t = values[name]
        assert tuple(t.shape) == tuple(shape), (name, t.shape, shape)
        flat[off:off + t.numel()] = t.reshape(-1)
    return flat


def split_flat(group, flat):
    """Inverse of full_flat: name -> tensor (a clone, global/TP-local shape)."""
    return {n: flat[o:o + math.prod(s)].detach().reshape(s).clone() for n, o, s in zip(group.names, group.offsets, group.shapes)}


def template_states(files, groups_shapes):
    """Rebuild each group's flat fp32 / exp_avg / exp_avg_sq from a template's rank files
    (in DP rank order) and split them per parameter: [{name: {state: tensor}}] per group."""
    sds = [load(f)["optimizer_state_dict"] for f in files]
    tpl_dp = len(sds)
    out = []
    for g, shapes in enumerate(groups_shapes):
        pad = sds[0]["param_alignment_paddings"][g]
        grp = Group(list(shapes), list(shapes.values()), pad, tpl_dp)
        assert all(sd["partition_count"][g] == tpl_dp for sd in sds)
        lean = torch.cat([sd["single_partition_of_fp32_groups"][g] for sd in sds])
        assert lean.numel() == grp.padded_group_numel, (g, lean.numel(), grp.padded_group_numel)
        states = {"fp32": torch.cat([lean, torch.zeros(grp.total - lean.numel())])}
        for k in ("exp_avg", "exp_avg_sq"):
            parts = [sd["base_optimizer_state"]["state"][g][k] for sd in sds]
            assert all(p.numel() == grp.partition_size for p in parts), "elastic_checkpoint layout not supported"
            states[k] = torch.cat(parts)
            assert not states[k][grp.padded_group_numel:].any()
        per = {k: split_flat(grp, v) for k, v in states.items()}
        out.append({n: {k: per[k][n] for k in per} for n in grp.names})
    return out


def scale_ds_config(cfg, dp, tpl_dp):
    cfg = copy.deepcopy(cfg)
    if isinstance(cfg, dict) and "train_batch_size" in cfg:
        cfg["train_batch_size"] = cfg["train_batch_size"] // tpl_dp * dp
    return cfg


def write_zero_ranks(tag_dir, mp_rank, groups, values, tpl_sd, ds_config, dp):
    """Write zero_pp_rank_{r}_mp_rank_{mp_rank:02d}_optim_states.pt for r in 0..dp-1, shaped as
    the template rank 0's file (same keys in the same order, same pickled objects), with the
    partitions of `values` ([{name: {state: tensor}}] per group) at this DP."""
    flats = [{k: full_flat(grp, {n: v[n][k] for n in grp.names}) for k in ("fp32", "exp_avg", "exp_avg_sq")}
             for grp, v in zip(groups, values)]
    osd_tpl = tpl_sd["optimizer_state_dict"]
    bos_tpl = osd_tpl["base_optimizer_state"]
    for r in range(dp):
        osd = collections.OrderedDict() if isinstance(osd_tpl, collections.OrderedDict) else {}
        paddings = [grp.padding(r) for grp in groups]
        for key, val in osd_tpl.items():
            if key == "base_optimizer_state":
                state = {}
                for g, grp in enumerate(groups):
                    st = {}
                    for k, v in bos_tpl["state"][g].items():
                        if k in ("exp_avg", "exp_avg_sq"):
                            s = grp.partition_size
                            st[k] = flats[g][k][r * s:(r + 1) * s].clone().requires_grad_(v.requires_grad)
                        else:
                            st[k] = v.clone() if torch.is_tensor(v) else copy.deepcopy(v)
                    state[g] = st
                val = {"state": state, "param_groups": copy.deepcopy(bos_tpl["param_groups"])}
            elif key == "single_partition_of_fp32_groups":
                val = []
                for g, grp in enumerate(groups):
                    s = grp.partition_size
                    # the engine's partitions are the optimizer's params: requires_grad as saved
                    rg = osd_tpl["single_partition_of_fp32_groups"][g].requires_grad
                    val.append(flats[g]["fp32"][r * s:r * s + s - paddings[g]].clone().requires_grad_(rg))
            elif key == "group_paddings":
                val = paddings
            elif key == "param_alignment_paddings":
                val = [list(grp.param_padding) for grp in groups]
            elif key == "partition_count":
                val = [dp] * len(groups)
            elif key == "param_slice_mappings":
                val = [grp.slice_mappings(r) for grp in groups]
            else:
                val = copy.deepcopy(val)
            osd[key] = val
        sd = {}
        for key, val in tpl_sd.items():
            sd[key] = osd if key == "optimizer_state_dict" else ds_config if key == "ds_config" else copy.deepcopy(val)
        torch.save(sd, os.path.join(tag_dir, f"zero_pp_rank_{r}_mp_rank_{mp_rank:02d}_optim_states.pt"))


def check_template_version(sd):
    import deepspeed
    v = sd.get("ds_version")
    assert str(v) == deepspeed.__version__, f"template written by deepspeed {v}, this is {deepspeed.__version__}"


def run_template(cmd, tpl):
    if os.path.exists(os.path.join(tpl, "latest")):
        log(f"template: reusing {tpl}")
        return
    log(f"template: running the real engine: {' '.join(cmd)}")
    t0 = time.perf_counter()
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-3000:] + r.stderr[-5000:])
        raise SystemExit(f"template run failed ({r.returncode})")
    log(f"template: done in {time.perf_counter() - t0:.1f} s")


def npz_key(name, state):
    return f"params/{name}/{state}.npy"


# ----------------------------------------------------------------------------- zero layout
def make_zero(a, tpl):
    tpl_dp = 2
    run_template([sys.executable, os.path.join(FIXTURES, "make_deepspeed.py"), tpl, "--stage", str(a.stage), "--dp",
                  str(tpl_dp), "--model", a.model, "--hidden", str(a.hidden), "--ffn", str(a.ffn), "--layers",
                  str(a.layers), "--steps", "2"], tpl)
    tag = open(os.path.join(tpl, "latest")).read().strip()
    src = os.path.join(tpl, tag)
    ms = load(os.path.join(src, "mp_rank_00_model_states.pt"))
    check_template_version(ms)
    assert ms["dp_world_size"] == tpl_dp
    rank_files = [os.path.join(src, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt") for r in range(tpl_dp)]
    tpl_sd0 = load(rank_files[0])
    stage = int(tpl_sd0["optimizer_state_dict"]["zero_stage"])
    assert stage == a.stage, (stage, a.stage)
    if (tpl_sd0["ds_config"].get("zero_optimization") or {}).get("round_robin_gradients"):
        raise SystemExit("round_robin_gradients reorders the flat group: not supported")
    values = template_states(rank_files, ms["param_shapes"])

    # The engine's own view of its states (safe_get_full_*), an independent check of step 2.
    ref = load(os.path.join(tpl, "reference_tp0.pt"))
    for gv in values:
        for n, st in gv.items():
            for k in st:
                assert torch.equal(st[k], ref[n][k].reshape(st[k].shape)), (n, k)

    dp = a.dp
    groups = [Group(list(shapes), list(shapes.values()), tpl_sd0["optimizer_state_dict"]["param_alignment_paddings"][g],
                    dp) for g, shapes in enumerate(ms["param_shapes"])]
    out_tag = os.path.join(a.out, tag)
    os.makedirs(out_tag)
    ds_config = scale_ds_config(tpl_sd0["ds_config"], dp, tpl_dp)
    log(f"zero: DP={dp} stage {stage}: groups " + ", ".join(
        f"{len(g.names)} params / {g.padded_group_numel} elements, partition {g.partition_size}, "
        f"padding on {sum(1 for r in range(dp) if g.padding(r))} ranks" for g in groups))
    t0 = time.perf_counter()
    write_zero_ranks(out_tag, 0, groups, values, tpl_sd0, ds_config, dp)
    log(f"zero: {dp} rank files in {time.perf_counter() - t0:.1f} s")

    msd = {}
    for key, val in ms.items():
        if key == "dp_world_size":
            val = dp
        elif key == "global_samples":
            val = val // tpl_dp * dp
        elif key == "ds_config":
            val = ds_config
        msd[key] = val
    torch.save(msd, os.path.join(out_tag, "mp_rank_00_model_states.pt"))
    for f in sorted(os.listdir(tpl)):  # latest, zero_to_fp32.py: the engine's own
        if os.path.isfile(os.path.join(tpl, f)) and not f.startswith("reference"):
            shutil.copyfile(os.path.join(tpl, f), os.path.join(a.out, f))

    if a.ref:
        module = ms["module"]
        picks = pick_params(groups, a.ref_count)
        arrays = {}
        info = ms.get("universal_checkpoint_info") or {}  # TP=1: only the vocabulary cut applies
        for g, name in picks:
            for k in ("fp32", "exp_avg", "exp_avg_sq"):
                arrays[npz_key(name, k)] = pipe_merge(name, [values[g][name][k]], info).detach().numpy()
            arrays[npz_key(name, "param")] = pipe_merge(name, [module[name]], info).detach().float().numpy()
        np.savez(a.ref, **arrays)
        log(f"ref: {len(picks)} params, {len(arrays)} arrays -> {a.ref}")


def pick_params(groups, count):
    """A spread of parameters: first and last of every group, the ones a rank boundary cuts,
    then evenly spaced ones."""
    picks = []
    for g, grp in enumerate(groups):
        cut = [n for n, o, s in zip(grp.names, grp.offsets, grp.shapes)
               if o // grp.partition_size != (o + max(math.prod(s), 1) - 1) // grp.partition_size]
        for n in [grp.names[0], grp.names[-1]] + cut[:2] + cut[-2:]:
            if (g, n) not in picks:
                picks.append((g, n))
    rest = [(g, n) for g, grp in enumerate(groups) for n in grp.names if (g, n) not in picks]
    need = max(count - len(picks), 0)
    if need and rest:
        step = max(len(rest) // need, 1)
        picks += rest[::step][:need]
    return picks


# ----------------------------------------------------------------------------- bloom layout
def pipe_merge(name, slices, info):
    """TP slices -> the global tensor in ds_to_universal.py's precedence (the same rules as
    tests/integration/test_deepspeed_pipe.py's pipe_merge): replicated (TP rank 0), averaged
    (Python's sum over the copies, then / n), two sub-params cat dim 0, row parallel (cat dim
    1), else cat dim 0; then the vocabulary cut."""
    def match(key):
        return any(re.match(p, name) for p in info.get(key, []))

    assert not info.get("parameter_with_sub_params")
    if len(slices) == 1 or match("tp_replicated_parameter_patterns"):
        full = slices[0]
    elif match("parameter_to_average_patterns"):
        full = sum(slices) / len(slices)
    elif match("parameter_with_2_sub_params_cat_dim_0"):
        halves = [s.chunk(2, 0) for s in slices]
        full = torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    else:
        full = torch.cat(slices, 1 if match("parameter_with_row_parallelism_patterns") else 0)
    if match("vocabulary_parameter_patterns"):
        full = full[:info["original_vocab_size"]]
    return full


def pipe_stages(layers, pp):
    """Spec index ranges per stage, as PipelineModule._partition_layers("type:transformer")
    computes them for make_deepspeed_pipe.py's specs: [tied embed, N x
    ParallelTransformerLayerPipe, NormPipe, tied logits]."""
    from deepspeed.runtime.utils import partition_balanced
    typenames = ["EmbeddingPipe"] + ["ParallelTransformerLayerPipe"] * layers + ["NormPipe", "EmbeddingPipe"]
    weights = [1 if re.search("transformer", t, re.IGNORECASE) else 0 for t in typenames]
    parts = partition_balanced(weights=weights, num_parts=pp)
    return [(parts[s], parts[s + 1]) for s in range(pp)], len(typenames)


def stage_of(name, n_specs):
    """Spec indices holding a global name (the tied embedding: the first and the last spec)."""
    if name.startswith("tied_modules."):
        return [0, n_specs - 1]
    return [int(name.split(".", 1)[0])]


def make_bloom(a, tpl):
    PP, TP, DP = a.pp, a.tp, a.dp
    run_template([sys.executable, os.path.join(FIXTURES, "make_deepspeed_pipe.py"), tpl, "--pp", "1", "--tp",
                  str(TP), "--dp", "1", "--stage", "1", "--dtype", "fp32", "--layers", str(a.layers), "--ffn",
                  str(a.ffn), "--steps", "2"], tpl)
    import make_deepspeed_pipe  # noqa: F401  (registers megatron.enums for the pickled args)
    tag = open(os.path.join(tpl, "latest")).read().strip()
    src = os.path.join(tpl, tag)
    ms = [load(os.path.join(src, f"mp_rank_{t:02d}_model_states.pt")) for t in range(TP)]
    check_template_version(ms[0])
    assert ms[0]["dp_world_size"] == 1 and ms[0]["mp_world_size"] == TP
    tpl_sds = [load(os.path.join(src, f"zero_pp_rank_0_mp_rank_{t:02d}_optim_states.pt")) for t in range(TP)]
    for sd in tpl_sds:
        assert int(sd["optimizer_state_dict"]["zero_stage"]) == 1
        assert not any(any(p) for p in sd["optimizer_state_dict"]["param_alignment_paddings"])
    values = [template_states([os.path.join(src, f"zero_pp_rank_0_mp_rank_{t:02d}_optim_states.pt")],
                              ms[t]["param_shapes"]) for t in range(TP)]
    for t in range(TP):  # the engine's own safe_get_full_* view
        ref = load(os.path.join(tpl, f"reference_pp0_tp{t}.pt"))
        for gv in values[t]:
            for n, st in gv.items():
                for k in st:
                    assert torch.equal(st[k], ref[n][k].reshape(st[k].shape)), (n, k)

    stages, n_specs = pipe_stages(a.layers, PP)
    out_tag = os.path.join(a.out, tag)
    os.makedirs(out_tag)
    ds_config = scale_ds_config(tpl_sds[0]["ds_config"], DP, 1)
    log(f"bloom: PP={PP} TP={TP} DP={DP}: stages " + " ".join(f"{b}-{e - 1}" for b, e in stages))
    t0 = time.perf_counter()
    nfiles = 0
    for s, (b, e) in enumerate(stages):
        for t in range(TP):
            mp_rank = s * TP + t
            shapes = [collections.OrderedDict((n, sh) for n, sh in g.items()
                                              if any(b <= i < e for i in stage_of(n, n_specs)))
                      for g in ms[t]["param_shapes"]]
            assert all(shapes), f"stage {s} has an empty param group"
            groups = [Group(list(sh), list(sh.values()), [0] * len(sh), DP) for sh in shapes]
            write_zero_ranks(out_tag, mp_rank, groups, values[t], tpl_sds[t], ds_config, DP)
            nfiles += DP
            msd = {}
            for key, val in ms[t].items():
                if key == "param_shapes":
                    val = shapes
                elif key == "dp_world_size":
                    val = DP
                elif key == "mp_world_size":
                    val = PP * TP
                elif key == "checkpoint_parallel_dimensions":
                    val = {"pp_degree": PP, "tp_degree": TP}
                elif key == "global_samples":
                    val = val * DP
                elif key == "ds_config":
                    val = ds_config
                elif key == "args":
                    val = copy.deepcopy(val)
                    val.pipeline_model_parallel_size, val.data_parallel_size = PP, DP
                    val.global_batch_size *= DP
                    val.consumed_train_samples *= DP
                msd[key] = val
            torch.save(msd, os.path.join(out_tag, f"mp_rank_{mp_rank:02d}_model_states.pt"))
        log(f"bloom: stage {s} done ({nfiles} ZeRO files, {time.perf_counter() - t0:.1f} s)")
    layer_files = sorted(f for f in os.listdir(src) if f.startswith("layer_"))
    for f in layer_files:  # layer files do not depend on PP or DP: the engine's own bytes
        shutil.copyfile(os.path.join(src, f), os.path.join(out_tag, f))
    for f in sorted(os.listdir(tpl)):
        if os.path.isfile(os.path.join(tpl, f)) and not f.startswith("reference"):
            shutil.copyfile(os.path.join(tpl, f), os.path.join(a.out, f))

    if a.ref:
        info = ms[0]["universal_checkpoint_info"]
        module = [load(os.path.join(tpl, f"reference_module_pp0_tp{t}.pt")) for t in range(TP)]
        # param.npy comes from the layer files: check the engine's module reference against them
        for t in range(TP):
            for f in layer_files:
                if f.endswith(f"-model_{t:02d}-model_states.pt"):
                    idx = int(f.split("_")[1].split("-")[0])
                    for local, v in load(os.path.join(src, f)).items():
                        name = f"tied_modules.embed.{local}" if idx == 0 else f"{idx}.{local}"
                        assert torch.equal(module[t][name], v), name
        groups = [Group(list(g), list(g.values()), [0] * len(g), DP) for g in ms[0]["param_shapes"]]
        picks = pick_bloom(ms[0]["param_shapes"], info, a.ref_count)
        arrays = {}
        for g, name in picks:
            for k in ("fp32", "exp_avg", "exp_avg_sq"):
                arrays[npz_key(name, k)] = pipe_merge(name, [values[t][g][name][k] for t in range(TP)], info).detach().numpy()
            arrays[npz_key(name, "param")] = pipe_merge(name, [module[t][name] for t in range(TP)], info).detach().float().numpy()
        del groups
        np.savez(a.ref, **arrays)
        log(f"ref: {len(picks)} params, {len(arrays)} arrays -> {a.ref}")


def pick_bloom(param_shapes, info, count):
    """The tied embedding (vocabulary cut), the final norm (replicated) and, from the first,
    middle and last transformer layers, one parameter of every merge rule (averaged norm, cat
    dim 0 qkv, row-parallel dense, replicated bias, two sub-params h_to_4h, row-parallel
    4h_to_h); then evenly spaced others up to `count`."""
    names = [(g, n) for g, sh in enumerate(param_shapes) for n in sh]
    layer_ids = sorted({int(n.split(".")[0]) for _, n in names if n[0].isdigit() and "layernorm" in n})
    rules = ["input_layernorm.weight", "self_attention.query_key_value.weight", "self_attention.dense.weight",
             "self_attention.dense.bias", "mlp.dense_h_to_4h.weight", "mlp.dense_4h_to_h.weight"]
    final = max(int(n.split(".")[0]) for _, n in names if n[0].isdigit())
    want = {"tied_modules.embed.word_embeddings.weight", f"{final}.weight", f"{final}.bias"}
    for i in (layer_ids[0], layer_ids[len(layer_ids) // 2], layer_ids[-1]):
        want |= {f"{i}.{r}" for r in rules}
    picks = [x for x in names if x[1] in want]
    rest = [x for x in names if x not in picks]
    need = max(count - len(picks), 0)
    if need and rest:
        picks += rest[::max(len(rest) // need, 1)][:need]
    return picks


# ----------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--layout", choices=["zero", "bloom"], default="zero")
    ap.add_argument("--dp", type=int, help="data-parallel degree (zero: 768, bloom: 8)")
    ap.add_argument("--stage", type=int, choices=[1, 2], default=2, help="zero: ZeRO stage")
    ap.add_argument("--pp", type=int, default=12, help="bloom: pipeline stages")
    ap.add_argument("--tp", type=int, default=4, help="bloom: tensor-parallel degree")
    ap.add_argument("--layers", type=int, default=70)
    ap.add_argument("--hidden", type=int, default=80, help="zero: hidden size of the template model")
    ap.add_argument("--ffn", type=int, help="ffn size of the template model (zero: 160, bloom: 8)")
    ap.add_argument("--model", choices=["gpt", "padspan"], default="gpt",
                    help="zero: template model (padspan: make_deepspeed.py's 2-parameter model, for checks)")
    ap.add_argument("--template", help="directory of the real small save (reused when present)")
    ap.add_argument("--ref", help="write the reference sample npz here")
    ap.add_argument("--ref-count", type=int, default=20)
    a = ap.parse_args()
    if a.dp is None:
        a.dp = 768 if a.layout == "zero" else 8
    if a.ffn is None:
        a.ffn = 160 if a.layout == "zero" else 8
    if os.path.exists(a.out):
        raise SystemExit(f"{a.out} exists")
    t0 = time.perf_counter()
    tmp = None
    tpl = a.template
    if not tpl:
        tmp = tempfile.mkdtemp(prefix="ds-scale-template-")
        tpl = os.path.join(tmp, "tpl")
    try:
        if a.layout == "zero":
            make_zero(a, tpl)
        else:
            make_bloom(a, tpl)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    n, size = 0, 0
    for d, _, fs in os.walk(a.out):
        for f in fs:
            n += 1
            size += os.path.getsize(os.path.join(d, f))
    log(f"done: {a.out}: {n} files, {size / 2**20:.1f} MiB, {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()

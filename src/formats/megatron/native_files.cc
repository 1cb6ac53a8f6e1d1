#include "formats/megatron/native_files.h"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "formats/megatron/megatron_common.h"
#include "formats/pickle_writer.h"
#include "formats/torch_save_writer.h"

namespace ckptfs::formats::megatron {
namespace {

// Megatron's legacy per-rank archive at the new degrees: {args (with the new
// TP/PP), checkpoint_version 3.0, iteration, model} with layer numbers local
// to the stage, and the `_extra_state` None entries Megatron's linear layers
// save. Optimizer states are in the safetensors rank files.
//
// `local_spec`: the run used mcore's local layer spec (args.transformer_impl),
// whose layer norms are modules of their own: the fused sharded-key names of
// a torch_dist / zarr source (linear_qkv.layer_norm_*, linear_fc1.layer_norm_*,
// the spec's sharded_state_dict_keys_map) are written as input_layernorm.* /
// pre_mlp_layernorm.*, the names its GPTModel.load_state_dict expects.
Result<ExportFile> RankArchive(const NativeFilesInput& in, const RankPlan& r, const std::string& args_ops,
                               bool local_spec) {
  const TopoPlan& p = in.plan;
  PickleWriter w;
  w.BeginDict();
  w.Str("args");
  w.Raw(args_ops);
  w.BeginDict();
  w.Str("tensor_model_parallel_size");
  w.Int(p.topo.tp);
  w.Str("pipeline_model_parallel_size");
  w.Int(p.topo.pp);
  w.Str("virtual_pipeline_model_parallel_size");
  w.None();
  w.Str("expert_model_parallel_size");
  w.Int(std::max(p.topo.ep, 1));
  w.EndDict();
  w.Build();
  w.Str("checkpoint_version");
  w.Float(3.0);
  w.Str("iteration");
  w.Int(std::max<int64_t>(in.info.step, 0));
  w.Str("model");
  w.BeginDict();
  std::vector<ArchiveStorage> storages;
  // Megatron's linear layers save `<module>._extra_state` (None) after their
  // parameters: emitted when the next tensor belongs to another module.
  std::string pending_extra;
  auto module_of = [](const std::string& n) { return n.substr(0, n.rfind('.')); };
  auto flush_extra = [&](const std::string& next) {
    if (!pending_extra.empty() && module_of(next) != module_of(pending_extra)) {
      w.Str(pending_extra);
      w.None();
      pending_extra.clear();
    }
  };
  const int64_t first_layer = p.stage_layers.empty() ? 0 : p.stage_layers[r.pp].first;
  for (const RankTensor& rt : r.tensors) {
    const TensorRecord& t = in.tensors[rt.id.v];
    if (t.role != Role::kParam || t.state != "param") continue;
    if (rt.zero_tail > 0)
      return Unsupported("'" + t.key +
                         "' needs vocabulary padding rows, which Megatron-native files do not synthesize");
    int64_t layer = -1;
    std::string local = RenumberLayer(t.fqn, -first_layer, &layer);
    if (p.num_experts > 0) {  // expert indices local to the EP rank
      int64_t expert;
      local = RenumberExpert(local, -r.ep * (p.num_experts / std::max(p.topo.ep, 1)), &expert);
    }
    if (local_spec) {
      for (const NormKey& k : kLocalSpecNormKeys) {
        const std::string fused = "." + std::string(k.sharded);
        if (const size_t at = local.find(fused); at != std::string::npos) {
          local.replace(at, fused.size(), "." + std::string(k.module));
        }
      }
    }
    const uint64_t numel = static_cast<uint64_t>(NumelOf(rt.shape));
    flush_extra(local);
    w.Str(local);
    RETURN_IF_ERROR(
        w.Tensor(std::to_string(storages.size()), t.dtype, numel, 0, rt.shape, ContiguousStrides(rt.shape)));
    ArchiveStorage st{rt.id.v, t.dtype, numel * DTypeSize(t.dtype), {}};
    if (!(rt.pieces.size() == 1 && rt.pieces[0].lengths == t.shape)) st.boxes = rt.pieces;
    storages.push_back(std::move(st));
    for (const char* lin : {".linear_qkv.weight", ".linear_proj.weight", ".linear_fc1.weight", ".linear_fc2.weight"}) {
      if (EndsWith(local, lin)) {
        pending_extra = local.substr(0, local.size() - 7) + "._extra_state";
      }
    }
    if (local == "output_layer.weight") pending_extra = "output_layer._extra_state";
  }
  flush_extra("");
  w.EndDict();
  w.EndDict();
  char dir[64];
  std::snprintf(dir, sizeof dir, "iter_%07lld/mp_rank_%02d", static_cast<long long>(std::max<int64_t>(in.info.step, 0)),
                r.tp);
  std::string path = dir;
  char suffix[16];
  if (p.topo.pp > 1) {
    std::snprintf(suffix, sizeof suffix, "_%03d", r.pp);
    path += suffix;
  }
  if (p.topo.ep > 1) {  // get_checkpoint_name: _EEE after _PPP
    std::snprintf(suffix, sizeof suffix, "_%03d", r.ep);
    path += suffix;
  }
  path += "/model_optim_rng.pt";
  return ExportFile{path, TorchSaveParts("model_optim_rng", w.Finish(), storages)};
}

}  // namespace

std::optional<TensorSplit> SplitByName(const std::string& fqn) {
  if (auto r = SplitRule(fqn, false); r && r->kind != Merge::kSub2) return SplitOf(*r);
  return std::nullopt;
}

Result<NativeFiles> NativeRankFiles(const NativeFilesInput& in) {
  NativeFiles out;
  const ExportFile* args = nullptr;
  bool local_spec = false;
  for (const ExportFile& x : in.exports) {
    if (x.path == kArgsPickle) args = &x;
    if (x.path == "args.json" && x.parts.size() == 1 && x.parts[0].kind == PartKind::kLiteral) {
      const auto a = nlohmann::json::parse(x.parts[0].literal, nullptr, false);
      local_spec = a.is_object() && a.value("transformer_impl", nlohmann::json()) == "local";
    }
  }
  if (args == nullptr || args->parts.empty()) return out;
  for (const RankPlan& r : in.plan.ranks) {
    ASSIGN_OR_RETURN(ExportFile f, RankArchive(in, r, args->parts[0].literal, local_spec));
    out.rank_files.push_back(std::move(f));
  }
  const std::string it = std::to_string(std::max<int64_t>(in.info.step, 0));
  out.others.push_back(ExportFile{"latest_checkpointed_iteration.txt",
                                  {ExportPart{PartKind::kLiteral, it, 0, DType::kInvalid, it.size(), {}}}});
  return out;
}

}  // namespace ckptfs::formats::megatron

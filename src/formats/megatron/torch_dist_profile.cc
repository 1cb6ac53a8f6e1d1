#include "formats/megatron/torch_dist_profile.h"

#include <re2/re2.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>
#include <tuple>
#include <utility>

#include "formats/megatron/megatron_common.h"
#include "formats/pickle_writer.h"
#include "formats/torch_save_writer.h"

namespace ckptfs::formats::megatron {
namespace {

// The linear layers whose `_extra_state` mcore saves as a ShardedObject per
// layer (mcore's local and Transformer Engine specs alike).
constexpr const char* kLinears[] = {"self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
                                    "mlp.linear_fc2"};

ExportFile Literal(std::string path, std::string bytes) {
  const uint64_t n = bytes.size();
  return ExportFile{std::move(path), {ExportPart{PartKind::kLiteral, std::move(bytes), 0, DType::kInvalid, n, {}}}};
}

// A layer parameter's name inside the stack, with the local spec's layer
// norms under their fused sharded keys.
std::string FusedName(const std::string& rest) {
  for (const NormKey& k : kLocalSpecNormKeys) {
    const std::string_view module = k.module;
    if (rest.compare(0, module.size(), module) == 0) return k.sharded + rest.substr(module.size());
  }
  return rest;
}

std::string Readme(const std::string& iter) {
  return "torch_dist/: this checkpoint as Megatron-LM's torch_dist checkpoint (megatron-core dist_checkpointing),\n"
         "the directory Megatron-LM's --load takes. megatron-core's dist_checkpointing.load reshards it to any\n"
         "TP / PP / DP, the distributed optimizer's state included (fully_reshardable):\n\n"
         "    --load <mount>/torch_dist --ckpt-format torch_dist   (Megatron-LM), or\n"
         "    sd = {\"model\": model.sharded_state_dict(),\n"
         "          \"optimizer\": optimizer.sharded_state_dict(model_sd, is_loading=True,\n"
         "                         metadata={\"distrib_optim_sharding_type\": \"fully_reshardable\"})}\n"
         "    state = dist_checkpointing.load(sd, \"<mount>/torch_dist/" +
         iter +
         "\")\n\n"
         "Keys are megatron-core's sharded keys: decoder.layers.* stacked on a leading axis of\n"
         "num_layers, the layer norms of mcore's local spec under their fused names\n"
         "(self_attention.linear_qkv.layer_norm_*, mlp.linear_fc1.layer_norm_*), and\n"
         "optimizer.state.{param,exp_avg,exp_avg_sq}.<key> for the fp32 master and Adam's moments\n"
         "(a MoE run: its experts stacked by layer and expert, decoder.layers.mlp.experts.experts.*, and\n"
         "its dense and expert optimizers under chained_0. and chained_1.).\n"
         "common.pt holds the run's args (at the source's degrees), iteration and the optimizer's\n"
         "param groups (with their step); the linear layers' _extra_state is None (mcore's local spec).\n"
         "A padded vocabulary keeps its stored padding (mcore loads it at the new padding).\n"
         "Nothing is converted ahead: every item is rendered from the source shards when it is read.\n\n";
}

}  // namespace

DcpProfile TorchDistProfile(const DcpProfileInput& in) {
  DcpProfile p;
  p.dir = "torch_dist";
  auto absent = [&](std::string why) {
    DcpProfile a;
    a.dir = p.dir;
    a.absent = std::move(why);
    return a;
  };
  const ExportFile* common = nullptr;
  std::string common_why;
  int64_t num_layers = -1, num_experts = -1;
  for (const ExportFile& x : in.exports) {
    if (x.parts.size() != 1 || x.parts[0].kind != PartKind::kLiteral) continue;
    if (x.path == kCommonWhy) common_why = x.parts[0].literal;
    if (x.path == kCommonPickle) common = &x;
    if (x.path == "args.json") {
      const auto a = nlohmann::json::parse(x.parts[0].literal, nullptr, false);
      if (a.is_object() && a.value("num_layers", nlohmann::json()).is_number_integer()) {
        num_layers = a["num_layers"].get<int64_t>();
      }
      if (a.is_object() && a.value("num_experts", nlohmann::json()).is_number_integer()) {
        num_experts = a["num_experts"].get<int64_t>();
      }
    }
  }
  static const RE2 layer_re(R"(decoder\.layers\.([0-9]{1,9})\.(.+))");
  // SequentialMLP's experts (global expert numbers under params/).
  static const RE2 expert_re(R"(mlp\.experts\.local_experts\.([0-9]{1,9})\.(.+))");
  struct Named {
    uint32_t id;
    std::string key;  // the parameter's sharded key
    int64_t layer;
    int64_t expert;
  };
  std::vector<Named> named;
  std::map<std::string, std::set<std::string>> states;  // sharded key -> optimizer states present
  int64_t max_layer = -1, max_expert = -1;
  std::set<std::pair<int64_t, std::string>> linears;                   // (layer, linear module) with a weight
  std::set<std::tuple<int64_t, int64_t, std::string>> expert_linears;  // (layer, expert, linear)
  for (uint32_t i = 0; i < in.tensors.size(); ++i) {
    const TensorRecord& t = in.tensors[i];
    if (t.role == Role::kHidden || t.alias || t.encoding != Encoding::kTensor) continue;
    const bool param = t.role == Role::kParam && t.state == "param";
    const bool state =
        t.role == Role::kOptimState && (t.state == "fp32" || t.state == "exp_avg" || t.state == "exp_avg_sq");
    if (!param && !state) continue;
    std::string rest, inner;
    int64_t layer = -1, expert = -1;
    std::string key;
    if (RE2::FullMatch(t.fqn, layer_re, &layer, &rest) && RE2::FullMatch(rest, expert_re, &expert, &inner)) {
      // mcore's SequentialMLP: experts.experts.<linear> stacked by layer and expert.
      key = "decoder.layers.mlp.experts.experts." + inner;
      max_layer = std::max(max_layer, layer);
      max_expert = std::max(max_expert, expert);
      for (const char* lin : {"linear_fc1", "linear_fc2"}) {
        if (inner == std::string(lin) + ".weight") expert_linears.emplace(layer, expert, lin);
      }
    } else if (t.fqn.find(".experts.") != std::string::npos) {
      return absent("'" + t.fqn + "': grouped-GEMM experts are not mapped to torch_dist keys");
    } else if (RE2::FullMatch(t.fqn, layer_re, &layer, &rest)) {
      key = "decoder.layers." + FusedName(rest);
      max_layer = std::max(max_layer, layer);
      for (const char* lin : kLinears) {
        if (rest == std::string(lin) + ".weight") linears.emplace(layer, lin);
      }
    } else if (t.fqn.rfind("embedding.", 0) == 0 || t.fqn.rfind("decoder.final_layernorm.", 0) == 0 ||
               t.fqn.rfind("output_layer.", 0) == 0) {
      key = t.fqn;
    } else {
      return absent("'" + t.fqn + "' has no megatron-core sharded key (not an mcore GPTModel name)");
    }
    named.push_back(Named{i, key, layer, expert});
    if (state) states[key].insert(t.state);
  }
  if (named.empty()) return absent("no parameters");
  if (!common_why.empty()) return absent("common.pt cannot be made: " + common_why);
  if (common == nullptr) return absent("not read from a Megatron run's common state (re-index with this ckptfs)");
  if (num_layers < 0) num_layers = max_layer + 1;
  if (max_layer >= num_layers) {
    return absent("layer " + std::to_string(max_layer) + " is past args.num_layers " + std::to_string(num_layers));
  }
  if (num_experts < 0) num_experts = max_expert + 1;
  if (max_expert >= num_experts) {
    return absent("expert " + std::to_string(max_expert) + " is past args.num_experts " + std::to_string(num_experts));
  }
  // With experts, megatron-core chains a dense and an expert optimizer, and
  // their keys carry the member's prefix.
  const bool chained = max_expert >= 0;

  for (const Named& n : named) {
    const TensorRecord& t = in.tensors[n.id];
    DcpProfileTensor e;
    e.tensor = n.id;
    if (n.layer >= 0) {
      e.stack_index = {n.layer};
      e.stack_size = {num_layers};
    }
    if (n.expert >= 0) {
      e.stack_index.push_back(n.expert);
      e.stack_size.push_back(num_experts);
    }
    const std::string optimizer = !chained        ? "optimizer"
                                  : n.expert >= 0 ? "chained_1.optimizer"
                                                  : "chained_0.optimizer";
    if (t.role == Role::kParam) {
      e.key = n.key;
      p.tensors.push_back(e);
      // An fp32 run's distributed optimizer keeps no master apart: the
      // weight is the optimizer's param.
      if (!states[n.key].count("fp32") && states[n.key].count("exp_avg")) {
        e.key = optimizer + ".state.param." + n.key;
        p.tensors.push_back(std::move(e));
      }
      continue;
    }
    e.key = optimizer + ".state." + std::string(t.state == "fp32" ? "param" : t.state) + "." + n.key;
    p.tensors.push_back(std::move(e));
  }

  // The linear layers' extra state: torch.save([None]), as mcore's
  // torch_dist strategy writes a ShardedObject's data (a list of the local
  // shards' objects) of the local spec's extra state.
  PickleWriter none;
  none.BeginList();
  none.None();
  none.EndList();
  const std::string none_item = TorchSaveBytes("archive", none.Finish());
  for (const auto& [layer, lin] : linears) {
    p.objects.push_back(DcpProfileObject{
        "decoder.layers." + lin + "._extra_state/shard_" + std::to_string(layer) + "_" + std::to_string(num_layers),
        none_item});
  }
  for (const auto& [layer, expert, lin] : expert_linears) {
    p.objects.push_back(DcpProfileObject{"decoder.layers.mlp.experts.experts." + lin + "._extra_state/shard_" +
                                             std::to_string(layer) + "." + std::to_string(expert) + "_" +
                                             std::to_string(num_layers) + "." + std::to_string(num_experts),
                                         none_item});
  }

  char iter[32];
  std::snprintf(iter, sizeof iter, "iter_%07lld", static_cast<long long>(std::max<int64_t>(in.info.step, 0)));
  p.dcp_dir = iter;
  p.files.push_back(Literal("latest_checkpointed_iteration.txt", std::to_string(std::max<int64_t>(in.info.step, 0))));
  p.files.push_back(Literal(p.dcp_dir + "/metadata.json",
                            "{\"sharded_backend\": \"torch_dist\", \"sharded_backend_version\": 1, "
                            "\"common_backend\": \"torch\", \"common_backend_version\": 1}"));
  PickleWriter w;
  w.Raw(common->parts[0].literal);
  p.files.push_back(ExportFile{p.dcp_dir + "/common.pt", TorchSaveParts("common", w.Finish(), {})});
  p.readme = Readme(p.dcp_dir);
  return p;
}

}  // namespace ckptfs::formats::megatron

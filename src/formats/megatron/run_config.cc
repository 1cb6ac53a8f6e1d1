#include "formats/megatron/run_config.h"

#include <yaml.h>

#include <charconv>
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

namespace ckptfs::formats::megatron {
namespace {

constexpr size_t kMaxDepth = 64;

std::optional<int64_t> Int(const std::map<std::string, std::string>& kv, const std::string& key) {
  auto it = kv.find(key);
  if (it == kv.end()) return std::nullopt;
  int64_t v = 0;
  const std::string& s = it->second;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
  return v;
}

std::optional<bool> Bool(const std::map<std::string, std::string>& kv, const std::string& key) {
  auto it = kv.find(key);
  if (it == kv.end()) return std::nullopt;
  if (it->second == "true" || it->second == "True") return true;
  if (it->second == "false" || it->second == "False") return false;
  return std::nullopt;
}

}  // namespace

Result<std::map<std::string, std::string>> YamlScalars(const std::string& text, const std::string& what) {
  // libyaml walks its stack of possible simple keys, one per open flow
  // collection, for every token: 100k nested '[' take 40 s. No run config
  // nests flow collections deeply; an upper bound of the depth (brackets
  // counted even inside quotes) is checked before parsing.
  int64_t depth = 0;
  for (char c : text) {
    depth += c == '[' || c == '{' ? 1 : c == ']' || c == '}' ? -1 : 0;
    if (depth > static_cast<int64_t>(kMaxDepth)) {
      return Invalid("cannot parse " + what + ": nested deeper than " + std::to_string(kMaxDepth) + " levels");
    }
  }
  yaml_parser_t parser;
  if (!yaml_parser_initialize(&parser)) return Internal("cannot parse " + what + ": libyaml out of memory");
  std::unique_ptr<yaml_parser_t, void (*)(yaml_parser_t*)> guard(&parser, yaml_parser_delete);
  yaml_parser_set_input_string(&parser, reinterpret_cast<const unsigned char*>(text.data()), text.size());
  // One frame per open collection: a mapping's path and whether the next
  // scalar is a key; a sequence's contents are skipped.
  struct Frame {
    bool mapping = false;
    std::string path;
    bool want_key = true;
    std::string key;
  };
  std::vector<Frame> stack;
  std::map<std::string, std::string> out;
  size_t skipping = 0;  // open collections inside a sequence
  auto value_done = [&] {
    if (!stack.empty() && stack.back().mapping) stack.back().want_key = true;
  };
  auto child_path = [&]() -> std::string {
    const Frame& f = stack.back();
    return f.path.empty() ? f.key : f.path + "." + f.key;
  };
  for (;;) {
    yaml_event_t ev;
    if (!yaml_parser_parse(&parser, &ev)) {
      return Invalid("cannot parse " + what + ": " + (parser.problem ? parser.problem : "not YAML") + " at line " +
                     std::to_string(parser.problem_mark.line + 1));
    }
    std::unique_ptr<yaml_event_t, void (*)(yaml_event_t*)> ev_guard(&ev, yaml_event_delete);
    const yaml_event_type_t type = ev.type;
    if (type == YAML_STREAM_END_EVENT || type == YAML_DOCUMENT_END_EVENT) break;
    const bool open = type == YAML_MAPPING_START_EVENT || type == YAML_SEQUENCE_START_EVENT;
    const bool close = type == YAML_MAPPING_END_EVENT || type == YAML_SEQUENCE_END_EVENT;
    if (skipping > 0) {
      skipping += open ? 1 : close ? -1 : 0;
      if (skipping == 0) value_done();
      continue;
    }
    if (open && stack.size() >= kMaxDepth) {
      return Invalid("cannot parse " + what + ": nested deeper than " + std::to_string(kMaxDepth) + " levels");
    }
    if (type == YAML_SEQUENCE_START_EVENT) {
      skipping = 1;
      continue;
    }
    if (type == YAML_MAPPING_START_EVENT) {
      Frame f;
      f.mapping = true;
      if (!stack.empty()) f.path = child_path();
      stack.push_back(std::move(f));
      continue;
    }
    if (type == YAML_MAPPING_END_EVENT) {
      if (!stack.empty()) stack.pop_back();
      value_done();
      continue;
    }
    if (type == YAML_SCALAR_EVENT || type == YAML_ALIAS_EVENT) {
      if (stack.empty()) continue;  // a document that is one scalar
      Frame& f = stack.back();
      if (f.want_key) {
        f.key = type == YAML_SCALAR_EVENT
                    ? std::string(reinterpret_cast<const char*>(ev.data.scalar.value), ev.data.scalar.length)
                    : "*";
        f.want_key = false;
      } else {
        if (type == YAML_SCALAR_EVENT) {
          out[child_path()] = std::string(reinterpret_cast<const char*>(ev.data.scalar.value), ev.data.scalar.length);
        }
        f.want_key = true;
      }
    }
  }
  return out;
}

Result<std::map<std::string, std::string>> Nemo2StrategyArgs(const std::string& text, const std::string& what) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("objects") || !j["objects"].is_object()) {
    return Invalid("cannot parse " + what + ": not fiddle's JSON serialization (no objects)");
  }
  static const std::string kRoot = "<root>.trainer.strategy.";
  std::map<std::string, std::string> out;
  for (const auto& [key, obj] : j["objects"].items()) {
    if (!obj.is_object() || !obj.contains("items") || !obj["items"].is_array()) continue;
    for (const nlohmann::json& item : obj["items"]) {
      if (!item.is_array() || item.size() != 2 || !item[1].is_object()) continue;
      const nlohmann::json& leaf = item[1];
      if (leaf.value("type", "") != "leaf" || !leaf.contains("value") || !leaf.contains("paths") ||
          !leaf["paths"].is_array()) {
        continue;
      }
      const nlohmann::json& v = leaf["value"];
      if (!v.is_primitive()) continue;
      for (const nlohmann::json& path : leaf["paths"]) {
        if (!path.is_string()) continue;
        const std::string p = path.get<std::string>();
        if (p.rfind(kRoot, 0) != 0) continue;
        out["strategy." + p.substr(kRoot.size())] = v.is_string() ? v.get<std::string>() : v.dump();
      }
    }
  }
  return out;
}

ModelFacts FactsOfConfig(const std::map<std::string, std::string>& kv, const std::string& model,
                         const std::string& ddp) {
  auto m = [&](const char* k) { return model + k; };
  auto d = [&](const char* k) { return ddp + k; };
  ModelFacts f;
  f.swiglu = Bool(kv, m("gated_linear_unit")).value_or(false);
  f.qkv_groups = Int(kv, m("num_query_groups")).value_or(Int(kv, m("num_attention_heads")).value_or(0));
  f.tp = Int(kv, m("tensor_model_parallel_size")).value_or(-1);
  f.pp = Int(kv, m("pipeline_model_parallel_size")).value_or(1);
  f.vp = Int(kv, m("virtual_pipeline_model_parallel_size")).value_or(1);
  f.num_layers = Int(kv, m("num_layers")).value_or(-1);
  f.first_stage_layers = Int(kv, m("num_layers_in_first_pipeline_stage")).value_or(-1);
  f.last_stage_layers = Int(kv, m("num_layers_in_last_pipeline_stage")).value_or(-1);
  auto impl = kv.find(m("transformer_impl"));
  f.local_impl = impl != kv.end() && impl->second == "local";
  f.overlap_grad_reduce = Bool(kv, d("overlap_grad_reduce")).value_or(false);
  f.ddp_bucket_size = Int(kv, d("bucket_size")).value_or(-1);
  f.tied = Bool(kv, m("share_embeddings_and_output_weights")).value_or(false);
  f.num_experts = Int(kv, m("num_moe_experts")).value_or(0);
  f.ep = Int(kv, m("expert_model_parallel_size")).value_or(1);
  // The tokenizer's vocabulary (Bridge pads it when should_pad_vocab is set).
  f.vocab = Int(kv, m("vocab_size")).value_or(-1);
  return f;
}

}  // namespace ckptfs::formats::megatron

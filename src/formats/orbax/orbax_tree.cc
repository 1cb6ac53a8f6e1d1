#include "formats/orbax/orbax_tree.h"

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>

#include "formats/byte_reader.h"

namespace ckptfs::formats::orbax {
namespace {

using json = nlohmann::json;

constexpr uint64_t kMaxMetadataFile = uint64_t{256} << 20;  // _sharding

std::string Base64Decode(std::string_view in) {
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char ch : in) {
    int v = ch >= 'A' && ch <= 'Z'   ? ch - 'A'
            : ch >= 'a' && ch <= 'z' ? ch - 'a' + 26
            : ch >= '0' && ch <= '9' ? ch - '0' + 52
            : ch == '+' || ch == '-' ? 62
            : ch == '/' || ch == '_' ? 63
                                     : -1;
    if (v < 0) continue;  // '=' padding
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xFF));
    }
  }
  return out;
}

// Mesh axes that are tensor parallelism by name (MaxText's "tensor" family,
// the "model" axis of the JAX docs, "tp" / "mp").
bool IsTensorAxis(const std::string& a) {
  return a == "model" || a == "tensor" || a == "tp" || a == "mp" || a == "tensor_transpose" || a == "tensor_sequence";
}

}  // namespace

namespace {

// The PartitionSpec's split: the first dimension over a tensor-parallel axis.
TensorSplit SplitOfSpec(const json& spec) {
  TensorSplit split;
  split.kind = SplitKind::kReplicate;
  int dim = 0;
  for (const json& e : spec) {
    const json axes = e.is_array() ? e : json::array({e});
    for (const json& a : axes) {
      if (a.is_string() && IsTensorAxis(a.get<std::string>()) && split.kind == SplitKind::kReplicate) {
        split.kind = SplitKind::kDim;
        split.dim = dim;
      }
    }
    ++dim;
  }
  return split;
}

// "data=2 x model=4" and the device count of one NamedSharding; empty when
// it names no mesh.
std::string MeshOf(const json& one, uint32_t* devices) {
  if (!one.contains("shape") || !one.contains("axis_names")) return "";
  try {
    auto shape = one["shape"].get<std::vector<int64_t>>();
    auto names = one["axis_names"].get<std::vector<std::string>>();
    if (shape.size() != names.size()) return "";
    std::string out;
    uint64_t n = 1;
    for (size_t i = 0; i < shape.size(); ++i) {
      out += (i ? " x " : "") + names[i] + "=" + std::to_string(shape[i]);
      n *= static_cast<uint64_t>(std::max<int64_t>(shape[i], 0));
    }
    *devices = static_cast<uint32_t>(std::min<uint64_t>(n, UINT32_MAX));
    return out;
  } catch (const json::exception&) {
    return "";
  }
}

}  // namespace

Sharding ReadSharding(const std::string& path) {
  Sharding out;
  auto text = ReadWholeFile(path, kMaxMetadataFile);
  if (!text.ok()) return out;
  json s = json::parse(*text, nullptr, false);
  if (!s.is_object()) return out;
  for (const auto& [k, v] : s.items()) {
    if (!v.is_string()) continue;
    json one = json::parse(v.get<std::string>(), nullptr, false);
    if (!one.is_object()) continue;
    if (out.mesh.empty()) out.mesh = MeshOf(one, &out.devices);
    if (one.contains("partition_spec") && one["partition_spec"].is_array()) {
      out.splits[Base64Decode(k)] = SplitOfSpec(one["partition_spec"]);
    }
  }
  return out;
}

void ClassifyPytree(std::vector<TensorRecord>& tensors, const std::vector<std::vector<std::string>>& paths) {
  // Flax variables: {"params": {"params": ...}} (MaxText's TrainState) when
  // every parameter's path repeats it.
  bool flax = false, any = false;
  for (size_t i = 0; i < tensors.size() && i < paths.size(); ++i) {
    const auto& p = paths[i];
    if (tensors[i].encoding != Encoding::kTensor || p.empty() || p[0] != "params") continue;
    any = true;
    flax = p.size() > 2 && p[1] == "params";
    if (!flax) break;
  }
  flax = flax && any;
  auto join = [](const std::vector<std::string>& p, size_t from) {
    std::string s;
    for (size_t i = from; i < p.size(); ++i) s += (i > from ? "." : "") + p[i];
    return s;
  };
  static const std::map<std::string, std::string> kStates = {
      {"mu", "exp_avg"}, {"nu", "exp_avg_sq"}, {"trace", "momentum_buffer"}};
  for (size_t i = 0; i < tensors.size() && i < paths.size(); ++i) {
    TensorRecord& t = tensors[i];
    const auto& p = paths[i];
    t.role = Role::kOther;
    t.fqn = t.key;
    t.state.clear();
    if (t.encoding != Encoding::kTensor || p.size() < 2) continue;
    if (p[0] == "params") {
      t.role = Role::kParam;
      t.fqn = join(p, flax ? 2 : 1);
      t.state = "param";
      continue;
    }
    if (p[0] != "opt_state") continue;
    for (size_t k = 1; k + 1 < p.size(); ++k) {
      auto it = kStates.find(p[k]);
      if (it == kStates.end()) continue;
      const size_t from = k + 1 + ((flax && p[k + 1] == "params" && k + 2 < p.size()) ? 1 : 0);
      t.role = Role::kOptimState;
      t.fqn = join(p, from);
      t.state = it->second;
      break;
    }
  }
}

}  // namespace ckptfs::formats::orbax

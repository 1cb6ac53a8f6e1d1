#include "formats/torchsave/meta_consolidated.h"

#include <algorithm>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "formats/byte_reader.h"
#include "formats/state_dict_roles.h"
#include "formats/torch_file.h"
#include "formats/torchsave/state_walk.h"
#include "formats/tp_merge.h"

namespace ckptfs::formats {
namespace {

// fairscale's split dimension of a weight of Meta's Llama (-1: replicated,
// -2: unknown). `tok_embeddings` is decided by the caller.
int SplitDim(const std::string& key, size_t ndim) {
  if (key == "output.weight") return 0;  // ColumnParallelLinear
  if (auto dim = LlamaLinearSplitDim(key)) return *dim;
  if (ndim <= 1 || key == "rope.freqs") return -1;
  return -2;
}

std::string ShardName(size_t k) {
  const std::string num = std::to_string(k);
  return "consolidated." + std::string(num.size() < 2 ? 2 - num.size() : 0, '0') + num + ".pth";
}

}  // namespace

Result<Checkpoint> ReadMetaConsolidated(const std::string& dir, std::vector<std::string> shards) {
  std::sort(shards.begin(), shards.end(), [](const std::string& a, const std::string& b) {
    return a.size() != b.size() ? a.size() < b.size() : a < b;
  });
  const size_t n = shards.size();
  for (size_t k = 0; k < n; ++k) {
    if (shards[k] != ShardName(k)) {
      return Invalid("cannot read " + dir + ": Meta model-parallel shards must be consolidated.00.pth .. " +
                     ShardName(n - 1) + "; " + ShardName(k) + " is missing (found " + shards[k] + ")");
    }
  }
  Checkpoint ck;
  ck.info.family = Family::kMetaConsolidated;
  ck.info.world_size = static_cast<uint32_t>(n);
  Files files;
  files.dir = dir;
  files.ck = &ck;
  std::vector<std::unique_ptr<Source>> src;
  std::vector<std::map<std::string, const PyValue*>> by_key(n);
  std::vector<std::vector<std::string>> order;  // shard 0's key paths, in its order
  size_t skipped = 0;
  bool too_deep = false;
  for (size_t k = 0; k < n; ++k) {
    src.push_back(files.Open(shards[k]));
    if (!src[k]->error.empty()) return Invalid("cannot read " + dir + ": " + src[k]->error);
    std::vector<Leaf> leaves;
    std::vector<std::string> path;
    WalkStateDict(src[k]->root(), path, leaves, &skipped, &too_deep);
    for (const Leaf& l : leaves) {
      if (k == 0) order.push_back(l.path);
      by_key[k].emplace(JoinPath(l.path), l.v);
    }
    if (by_key[k].size() != by_key[0].size()) {
      return Invalid("cannot read " + dir + ": " + shards[k] + " holds " + std::to_string(by_key[k].size()) +
                     " tensors, " + shards[0] + " " + std::to_string(by_key[0].size()) +
                     ": the model-parallel shards are of different models");
    }
  }
  // params.json (optional): the model's dim and vocab_size tell the
  // embedding's split apart.
  int64_t dim = -1, vocab = -1;
  if (auto text = ReadWholeSourceFile(dir, "params.json", uint64_t{1} << 20); text.ok()) {
    const nlohmann::json j = nlohmann::json::parse(*text, nullptr, false);
    if (j.is_object()) {
      if (j.contains("dim") && j["dim"].is_number_integer()) dim = j["dim"].get<int64_t>();
      if (j.contains("vocab_size") && j["vocab_size"].is_number_integer()) vocab = j["vocab_size"].get<int64_t>();
    } else {
      ck.info.problems.push_back("params.json is not a JSON object; not used");
    }
  }
  const PyValue* out0 = by_key[0].count("output.weight") ? by_key[0]["output.weight"] : nullptr;
  auto out_loc = out0 ? Resolve(*src[0], out0, shards[0] + " 'output.weight'") : Result<Loc>(Invalid(""));

  std::vector<std::vector<std::string>> paths;
  std::string sample_key;  // the first split weight, and where each shard holds it
  std::vector<Loc> sample;
  for (const std::vector<std::string>& path : order) {
    TensorRecord t;
    t.key = JoinPath(path);
    t.encoding = Encoding::kTensor;
    std::vector<Loc> locs;
    std::string error;
    for (size_t k = 0; k < n && error.empty(); ++k) {
      auto it = by_key[k].find(t.key);
      if (it == by_key[k].end()) {
        error = "cannot index '" + t.key + "': " + shards[k] + " does not hold it";
        break;
      }
      auto loc = Resolve(*src[k], it->second, shards[k] + " '" + t.key + "'");
      if (!loc.ok()) {
        error = loc.status().message();
        break;
      }
      if (!locs.empty() && (loc->dtype != locs[0].dtype || loc->shape.size() != locs[0].shape.size())) {
        error = "cannot index '" + t.key + "': " + shards[k] + " gives it another dtype or rank than " + shards[0];
        break;
      }
      locs.push_back(std::move(*loc));
    }
    int split = error.empty() ? SplitDim(t.key, locs[0].shape.size()) : -1;
    if (error.empty() && t.key == "tok_embeddings.weight" && locs[0].shape.size() == 2) {
      const std::vector<int64_t>& s = locs[0].shape;
      const int64_t nn = static_cast<int64_t>(n);
      if (vocab > 0 && s[0] * nn == vocab) {
        split = 0;  // VocabParallelEmbedding (Llama 3)
      } else if (dim > 0 && s[1] * nn == dim) {
        split = 1;  // ParallelEmbedding (Llama 2)
      } else if (out_loc.ok() && out_loc->shape.size() == 2) {
        split = s[1] == out_loc->shape[1] ? 0 : s[1] * nn == out_loc->shape[1] ? 1 : -2;
      } else {
        split = -2;
      }
    }
    if (error.empty() && split == -2) {
      error = "cannot index '" + t.key + "': its split dimension across the " + std::to_string(n) +
              " model-parallel shards is unknown (not a weight of Meta's Llama reference model)";
    }
    if (error.empty()) {
      // Every extent but the split one must agree.
      for (size_t k = 1; k < n && error.empty(); ++k) {
        for (size_t d = 0; d < locs[0].shape.size(); ++d) {
          if (static_cast<int>(d) != split && locs[k].shape[d] != locs[0].shape[d]) {
            error = "cannot index '" + t.key + "': " + shards[k] + " gives it shape " + ShapeStr(locs[k].shape) + ", " +
                    shards[0] + " " + ShapeStr(locs[0].shape);
            break;
          }
        }
      }
    }
    std::vector<Fragment> frags;
    if (error.empty()) {
      t.dtype = locs[0].dtype;
      t.shape = locs[0].shape;
      if (split < 0) {
        frags.push_back(WholeFragment(locs[0], src[0]->file));  // replicated: rank 0's copy
      } else {
        int64_t at = 0;
        for (size_t k = 0; k < n; ++k) {
          Fragment f = WholeFragment(locs[k], src[k]->file);
          f.offsets[split] = at;
          at += locs[k].shape[split];
          if (NumelOf(f.lengths) > 0) frags.push_back(std::move(f));
        }
        t.shape[split] = at;
        if (sample.empty()) sample_key = t.key, sample = locs;
      }
      t.byte_size = NumelOf(t.shape) * DTypeSize(t.dtype);
    } else {
      t.error = error;
      t.dtype = locs.empty() ? DType::kU8 : locs[0].dtype;
      t.shape.assign(1, 0);
      ck.info.Flag(Check::kCoverage, Severity::kError, t.key, "", error);
    }
    ck.fragments.Resize(ck.tensors.size() + 1);
    if (!frags.empty()) ck.fragments.Set(ck.tensors.size(), frags);
    t.num_fragments = static_cast<uint32_t>(frags.size());
    paths.push_back(path);
    ck.tensors.push_back(std::move(t));
  }
  // The shards name no rank, so a shard copied over another would merge
  // silently: a split weight's slices are distinct in any trained model, so
  // the first 4 KiB of one are compared across the shards (all-zero slices,
  // an untrained model's, prove nothing and are skipped).
  std::map<std::string, size_t> seen;
  for (size_t k = 0; k < sample.size(); ++k) {
    auto head = src[k]->reader->ReadAt(sample[k].data_offset, std::min<uint64_t>(sample[k].data_length, 4096));
    if (!head.ok()) return head.status();
    if (head->find_first_not_of('\0') == std::string::npos) break;
    auto [it, fresh] = seen.emplace(std::move(*head), k);
    if (!fresh) {
      return Invalid("cannot read " + dir + ": " + shards[k] + " holds the same '" + sample_key + "' bytes as " +
                     shards[it->second] + ": one shard copied over another, not two model-parallel ranks");
    }
  }
  ClassifyStateDict(ck.tensors, paths);
  if (skipped > 0) ck.info.problems.push_back(std::to_string(skipped) + " non-tensor entries are not shown");
  if (too_deep) ck.info.problems.push_back("entries nested deeper than 32 levels are not shown");
  if (std::string note = files.PlaceholderNote(); !note.empty()) ck.info.problems.push_back(std::move(note));
  ck.info.format_note = "Meta model-parallel checkpoint: " + std::to_string(n) +
                        " consolidated.NN.pth shards merged by fairscale's split dimensions" +
                        (dim > 0 ? ", params.json" : "");
  return ck;
}

}  // namespace ckptfs::formats

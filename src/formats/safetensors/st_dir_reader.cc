#include "formats/safetensors/st_dir_reader.h"

#include <re2/re2.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "ckptfs/geometry.h"
#include "formats/byte_reader.h"
#include "formats/safetensors/safetensors_header.h"
#include "formats/tiling.h"

namespace ckptfs::formats {
namespace {

using json = nlohmann::json;

constexpr char kIndexName[] = "model.safetensors.index.json";
constexpr uint64_t kMaxIndexJson = uint64_t{64} << 20;
constexpr size_t kMaxFiles = size_t{1} << 16;

bool IsSafetensorsName(const std::string& n) {
  return n.size() > 12 && n.compare(n.size() - 12, 12, ".safetensors") == 0 && n[0] != '.';
}

std::vector<std::string> SafetensorsIn(const std::string& dir) {
  std::vector<std::string> out;
  for (const std::string& n : ListDirectory(dir)) {
    if (IsSafetensorsName(n)) out.push_back(n);
  }
  return out;
}

// weight_map of model.safetensors.index.json: tensor -> file.
Result<std::map<std::string, std::string>> ReadWeightMap(const std::string& dir) {
  const std::string path = dir + "/" + kIndexName;
  ASSIGN_OR_RETURN(std::string text, ReadWholeSourceFile(dir, kIndexName, kMaxIndexJson));
  const json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
    return Invalid("cannot parse " + path + ": not a JSON object with a \"weight_map\" object");
  }
  std::map<std::string, std::string> out;
  for (const auto& [name, file] : j["weight_map"].items()) {
    if (!file.is_string()) return Invalid("cannot parse " + path + ": weight_map['" + name + "'] is not a file name");
    const std::string f = file.get<std::string>();
    if (!IsSafetensorsName(f) || f.find('/') != std::string::npos) {
      return Invalid("cannot parse " + path + ": weight_map['" + name + "'] = '" + f +
                     "' is not a .safetensors file in the directory");
    }
    out.emplace(name, f);
  }
  return out;
}

struct Chunk {
  uint32_t file = 0;
  SafetensorsEntry entry;
  std::vector<int64_t> offsets;
  bool placed = false;  // offsets from DCP_SHARDING_INFO
};

}  // namespace

bool LooksLikeSafetensorsDir(const std::string& dir) {
  return !SafetensorsIn(dir).empty() || !SafetensorsIn(dir + "/sharded").empty();
}

Result<Checkpoint> ReadSafetensorsDir(const std::string& dir) {
  Checkpoint ck;
  ck.info.family = Family::kSafetensors;
  std::map<std::string, std::string> weight_map;
  std::vector<std::string> rels;
  std::string prefix;
  if (::access((dir + "/" + kIndexName).c_str(), F_OK) == 0) {
    ASSIGN_OR_RETURN(weight_map, ReadWeightMap(dir));
    std::set<std::string> files;
    for (const auto& [name, f] : weight_map) files.insert(f);
    rels.assign(files.begin(), files.end());
  } else {
    rels = SafetensorsIn(dir);
    if (rels.empty()) {  // HuggingFaceStorageWriter's shards only
      prefix = "sharded/";
      rels = SafetensorsIn(dir + "/sharded");
    }
  }
  if (rels.empty()) return NotFound("cannot read " + dir + ": no .safetensors files");
  if (rels.size() > kMaxFiles) {
    return Invalid("cannot read " + dir + ": " + std::to_string(rels.size()) + " safetensors files (at most " +
                   std::to_string(kMaxFiles) + ")");
  }
  if (prefix.empty() && !SafetensorsIn(dir + "/sharded").empty()) {
    ck.info.problems.push_back(
        "sharded/ not read: it holds the per-rank shards of the consolidated files read here "
        "(mount " +
        dir + "/sharded to read the shards)");
  }

  // Every file's header; a file that cannot be read is a finding, and the
  // tensors the index puts in it are refused.
  std::map<std::string, std::vector<Chunk>> chunks;  // tensor name -> chunks, in file order
  std::map<std::string, std::string> bad_files;      // file -> why it cannot be read
  bool sharded = false;
  std::set<uint32_t> ranks;
  // HuggingFaceStorageWriter names shards shard-<rank+1>-model-<k>-of-<n>.
  static const RE2 kShardRe(R"(shard-0*([0-9]{1,9})-model-0*([0-9]{1,9})-of-0*([0-9]{1,9})\.safetensors)");
  std::set<std::pair<uint32_t, uint32_t>> shard_files;  // (rank, k)
  uint32_t shard_n = 0;
  for (const std::string& r : rels) {
    const uint32_t id = static_cast<uint32_t>(ck.files.size());
    ck.files.push_back(SourceFile{prefix + r, 0, 0, 0});
    SourceFile& sf = ck.files.back();
    auto fd = OpenAndFingerprint(dir, sf);
    Result<SafetensorsHeader> h =
        fd.ok() ? ReadSafetensorsHeader(*fd, 0, sf.size, dir + "/" + sf.rel_path) : fd.status();
    Result<std::map<std::string, std::vector<int64_t>>> sharding =
        h.ok() ? DcpShardingInfo(*h, dir + "/" + sf.rel_path) : h.status();
    if (fd.ok()) ::close(*fd);
    if (!sharding.ok()) {
      ck.info.Flag(Check::kCoverage, Severity::kError, "", sf.rel_path, sharding.status().message());
      bad_files.emplace(r, sharding.status().message());
      continue;
    }
    if (uint32_t rank = 0, k = 0, n = 0; RE2::FullMatch(r, kShardRe, &rank, &k, &n)) {
      ranks.insert(rank);
      shard_files.emplace(rank, k);
      shard_n = std::max(shard_n, n);
    }
    for (SafetensorsEntry& e : h->entries) {
      Chunk c;
      c.file = id;
      auto so = sharding->find(e.name);
      c.placed = so != sharding->end();
      c.offsets = c.placed ? so->second : std::vector<int64_t>(e.shape.size(), 0);
      sharded = sharded || c.placed;
      c.entry = std::move(e);
      chunks[c.entry.name].push_back(std::move(c));
    }
  }
  for (const auto& [name, f] : weight_map) {
    if (!chunks.count(name) && !bad_files.count(f)) {
      ck.info.Flag(Check::kCoverage, Severity::kError, name, f,
                   std::string(kIndexName) + " maps '" + name + "' to " + f + ", which has no such tensor");
    }
  }

  // A shard that is unreadable or missing (a gap in shard-<rank>-model-<k>-
  // of-<n>) may have held a chunk of any tensor and decided its global shape
  // (the chunks' extent): in a sharded directory every tensor is refused.
  // (The last rank's files missing altogether leave no trace to find.)
  std::string shards_broken;
  if (sharded || !shard_files.empty()) {
    if (!bad_files.empty()) shards_broken = bad_files.begin()->second;
    const uint32_t last_rank = ranks.empty() ? 0 : *ranks.rbegin();
    for (uint64_t r = 1; shards_broken.empty() && r <= last_rank; ++r) {
      for (uint64_t k = 1; k <= shard_n; ++k) {
        if (shard_files.count({static_cast<uint32_t>(r), static_cast<uint32_t>(k)})) continue;
        char name[96];
        std::snprintf(name, sizeof name, "shard-%05llu-model-%05llu-of-%05u.safetensors",
                      static_cast<unsigned long long>(r), static_cast<unsigned long long>(k), shard_n);
        shards_broken = std::string(name) + " is missing (rank " + std::to_string(r - 1) + "'s shard " +
                        std::to_string(k) + " of " + std::to_string(shard_n) + ")";
        ck.info.Flag(Check::kCoverage, Severity::kError, "", prefix + name, shards_broken);
        break;
      }
    }
  }

  // One record per tensor name (and one per name the index promises in a file
  // that could not be read, refused with that file's error).
  for (const auto& [name, f] : weight_map) {
    if (bad_files.count(f)) chunks.emplace(name, std::vector<Chunk>{});
  }
  ck.fragments.Resize(chunks.size());
  for (auto& entry : chunks) {
    const std::string& name = entry.first;  // a variable, not a binding: clang 14 cannot capture bindings
    std::vector<Chunk>& cs = entry.second;
    const size_t ti = ck.tensors.size();
    TensorRecord t;
    t.key = name;
    t.fqn = name;
    t.state = "param";
    t.role = Role::kParam;
    t.encoding = Encoding::kTensor;
    auto refuse = [&](const std::string& why) {
      t.error = "cannot index '" + name + "' (" + dir + "): " + why;
      t.dtype = cs.empty() ? DType::kU8 : cs[0].entry.dtype;
      t.shape.assign(1, 0);
      ck.tensors.push_back(std::move(t));
    };
    if (cs.empty()) {
      refuse(bad_files[weight_map[name]]);
      continue;
    }
    if (!shards_broken.empty()) {
      refuse(shards_broken + ": the shards' chunks and global shapes are incomplete");
      continue;
    }
    t.dtype = cs[0].entry.dtype;
    t.shape = cs[0].entry.shape;
    std::string why;
    for (const Chunk& c : cs) {
      if (c.entry.dtype != t.dtype || c.entry.shape.size() != t.shape.size()) {
        why = "its chunks disagree on dtype or rank (" + ck.files[cs[0].file].rel_path + ", " +
              ck.files[c.file].rel_path + ")";
      } else if (!c.placed && cs.size() > 1) {
        why = "it is in " + ck.files[cs[0].file].rel_path + " and " + ck.files[cs[1].file].rel_path +
              " with no DCP_SHARDING_INFO to place the copies";
      } else if (c.offsets.size() != c.entry.shape.size()) {
        why = "DCP_SHARDING_INFO of " + ck.files[c.file].rel_path + " gives " + std::to_string(c.offsets.size()) +
              " offsets for a tensor of " + std::to_string(c.entry.shape.size()) + " dimensions";
      }
      if (!why.empty()) break;
      for (size_t d = 0; d < t.shape.size(); ++d) {  // the global shape: the chunks' extent
        t.shape[d] = std::max(t.shape[d], c.offsets[d] + c.entry.shape[d]);
      }
    }
    if (why.empty()) why = CheckTensorGeometry(t, {});
    if (!why.empty()) {
      refuse(why);
      ck.info.Flag(Check::kCoverage, Severity::kError, name, "", ck.tensors.back().error);
      continue;
    }
    if (auto it = weight_map.find(name);
        it != weight_map.end() && ck.files[cs[0].file].rel_path != prefix + it->second) {
      ck.info.problems.push_back(std::string(kIndexName) + " maps '" + name + "' to " + it->second +
                                 "; it is read from " + ck.files[cs[0].file].rel_path);
    }
    std::vector<Fragment> frags;
    for (const Chunk& c : cs) {
      Fragment f;
      f.file = FileId{c.file};
      f.offsets = c.offsets;
      f.lengths = c.entry.shape;
      f.strides = ContiguousStrides(c.entry.shape);
      f.dtype = c.entry.dtype;
      f.data_offset = c.entry.begin;
      f.data_length = c.entry.end - c.entry.begin;
      frags.push_back(std::move(f));
    }
    t.byte_size = t.Numel() * DTypeSize(t.dtype);
    std::string detail;
    if (Status s = CheckTiling(t, frags, ck.files, &detail); !s.ok()) {
      t.error = s.Annotate("tensor '" + name + "' in " + dir).message();
      ck.info.Flag(Check::kCoverage, Severity::kError, name, "", t.error, detail);
    } else {
      ck.fragments.Set(ti, frags);
      t.num_fragments = static_cast<uint32_t>(frags.size());
    }
    ck.tensors.push_back(std::move(t));
  }
  ck.info.world_size = static_cast<uint32_t>(ranks.size());
  ck.info.format_note =
      sharded ? "DCP HuggingFaceStorageWriter shards (DCP_SHARDING_INFO), " + std::to_string(rels.size()) + " files"
              : "Hugging Face safetensors, " + std::to_string(rels.size()) + " file(s)" +
                    (weight_map.empty() ? "" : std::string(" (") + kIndexName + ")");
  ck.info.step = TrainerStateStep(dir);  // HF Trainer writes it beside the weights
  return ck;
}

}  // namespace ckptfs::formats

#include "formats/orbax/orbax_reader.h"

#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_map>

#include "ckptfs/formats.h"
#include "ckptfs/geometry.h"
#include "common/json_text.h"
#include "formats/byte_reader.h"
#include "formats/orbax/ocdbt.h"
#include "formats/orbax/orbax_tree.h"
#include "formats/orbax/zarr_arrays.h"
#include "formats/torch_file.h"

namespace ckptfs::formats {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;
using orbax::ZarrArray;

constexpr uint64_t kMaxMetadataFile = uint64_t{256} << 20;  // _METADATA, _sharding, .zarray ...
constexpr uint64_t kMaxChunksPerArray = uint64_t{1} << 22;
// An array is indexed chunk by chunk, absent chunks included (each a hole):
// a grid with far more chunks than the database or directory holds (a
// damaged or hostile shape) is refused before that loop.
constexpr uint64_t kMaxAbsentChunks = 4096;
constexpr const char* kTmpMark = ".orbax-checkpoint-tmp";

bool IsFile(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}
bool IsDir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// An item directory: orbax's pytree metadata beside an OCDBT database or the
// per-process array metadata.
bool IsItemDir(const std::string& d) {
  return IsFile(d + "/_METADATA") &&
         (IsFile(d + "/manifest.ocdbt") || IsDir(d + "/array_metadatas") || IsFile(d + "/_sharding"));
}

std::vector<std::string> ItemsOf(const std::string& step_dir) {
  std::vector<std::string> items;
  for (const std::string& n : ListDirectory(step_dir)) {
    if (n != kIndexDirName && n.find(kTmpMark) == std::string::npos && IsItemDir(step_dir + "/" + n)) {
      items.push_back(n);
    }
  }
  return items;
}

bool IsStepDir(const std::string& d) { return IsFile(d + "/_CHECKPOINT_METADATA") || !ItemsOf(d).empty(); }

// The step number in a step directory's name: "12", or "<prefix>_12"
// (CheckpointManager's step_prefix); -1 when it has none.
int64_t StepNumber(const std::string& name) {
  size_t i = name.size();
  while (i > 0 && name[i - 1] >= '0' && name[i - 1] <= '9') --i;
  if (i == name.size() || name.size() - i > 18) return -1;
  if (i > 0 && name[i - 1] != '_') return -1;
  return std::stoll(name.substr(i));
}

struct Layout {
  std::string step_rel;  // "" when `dir` is a step or item directory
  int64_t step = -1;
  std::vector<std::string> items;  // relative to dir ("" when dir is the item)
  std::vector<std::string> other_steps, unfinished;
};

Result<Layout> Discover(const std::string& dir) {
  Layout l;
  if (IsItemDir(dir)) {
    l.items.push_back("");
    return l;
  }
  if (IsStepDir(dir)) {
    for (const std::string& it : ItemsOf(dir)) l.items.push_back(it);
  } else {
    std::map<int64_t, std::string> steps;
    for (const std::string& n : ListDirectory(dir)) {
      if (n.find(kTmpMark) != std::string::npos) {
        l.unfinished.push_back(n);
        continue;
      }
      const int64_t s = StepNumber(n);
      if (s >= 0 && IsStepDir(dir + "/" + n)) steps[s] = n;
    }
    if (steps.empty()) {
      return NotFound(
          "cannot read " + dir + ": no finished orbax step directory" +
          (l.unfinished.empty() ? std::string() : " (unfinished saves, never read: " + l.unfinished.front() + ")"));
    }
    l.step = steps.rbegin()->first;
    l.step_rel = steps.rbegin()->second;
    for (const auto& [s, n] : steps) {
      if (n != l.step_rel) l.other_steps.push_back(n);
    }
    for (const std::string& it : ItemsOf(dir + "/" + l.step_rel)) l.items.push_back(l.step_rel + "/" + it);
  }
  if (l.items.empty()) return NotFound("cannot read " + dir + ": an orbax step directory without an item directory");
  return l;
}

// One leaf of the pytree (_METADATA's tree_metadata).
struct Leaf {
  std::vector<std::string> path;
  std::string name;  // orbax's param name: the keys joined with '.'
  std::string value_type;
  bool skip = false;
};

Result<std::vector<Leaf>> ReadTreeMetadata(const std::string& path, json* top) {
  ASSIGN_OR_RETURN(std::string text, ReadWholeFile(path, kMaxMetadataFile));
  *top = json::parse(text, nullptr, false);
  if (top->is_discarded() || !top->is_object()) return Invalid("cannot parse " + path + ": not a JSON object");
  std::vector<Leaf> leaves;
  try {
    const json& tree = top->at("tree_metadata");
    if (!tree.is_object()) return Invalid("cannot parse " + path + ": tree_metadata is not an object");
    for (const auto& [k, v] : tree.items()) {
      Leaf leaf;
      for (const json& km : v.at("key_metadata")) {
        const json& key = km.at("key");
        leaf.path.push_back(key.is_string() ? key.get<std::string>() : key.dump());
      }
      if (leaf.path.empty()) leaf.path.push_back(k);
      for (size_t i = 0; i < leaf.path.size(); ++i) leaf.name += (i ? "." : "") + leaf.path[i];
      const json& vm = v.value("value_metadata", json::object());
      leaf.value_type = vm.value("value_type", std::string());
      leaf.skip = vm.value("skip_deserialize", false);
      leaves.push_back(std::move(leaf));
    }
  } catch (const json::exception& e) {
    return Invalid("cannot parse " + path + ": " + e.what());
  }
  std::sort(leaves.begin(), leaves.end(), [](const Leaf& a, const Leaf& b) { return a.name < b.name; });
  return leaves;
}

// Where a chunk's stored bytes are: an OCDBT value (out-of-line or inline in
// a node) or a whole chunk file.
struct Stored {
  FileId file;
  uint64_t offset = 0, length = 0;  // out-of-line / file: the bytes in `file`
  const orbax::OcdbtValue* inline_value = nullptr;
};

// Reads one item directory into `ck`.
class ItemReader {
 public:
  ItemReader(Files& files, std::string item_rel, std::string label)
      : files_(files), ck_(*files.ck), item_rel_(std::move(item_rel)), label_(std::move(label)) {}

  // Reads the item's arrays into the checkpoint (their pytree paths into
  // `paths`); `note` says its storage, `sharding` is its _sharding.
  Status Read(std::vector<std::vector<std::string>>* paths, std::string* note, orbax::Sharding* sharding);

 private:
  std::string Rel(const std::string& in_item) const { return item_rel_.empty() ? in_item : item_rel_ + "/" + in_item; }
  std::string Abs(const std::string& in_item) const { return files_.dir + "/" + Rel(in_item); }
  // Opens (once) file `in_item` of the item; nullptr with *error when it cannot be.
  Source* File(const std::string& in_item, std::string* error);
  Result<std::string> ReadValue(const Stored& s, uint64_t off, uint64_t len);
  Result<std::string> ArrayMetadataText(const std::string& name, bool* found_v3);
  bool Lookup(const std::string& key, Stored* out);
  // One array whose zarr metadata (`v3`: zarr.json) is `text`, or could not be read.
  void ReadArray(const Leaf& leaf, const Result<std::string>& text, bool v3,
                 std::vector<std::vector<std::string>>* paths);
  // Stored chunks of array `name` (keys or files under it), counted up to `cap`.
  uint64_t StoredChunks(const std::string& name, uint64_t cap) const;
  Status ChunkFragments(const ZarrArray& a, const Stored& s, const std::string& where,
                        const std::vector<int64_t>& origin, std::vector<Fragment>* frags);

  Files& files_;
  Checkpoint& ck_;
  std::string item_rel_, label_;
  std::map<std::string, std::unique_ptr<Source>> open_;
  std::unordered_map<uint32_t, Source*> by_file_;
  bool ocdbt_ = false;
  orbax::OcdbtListing listing_;
  std::unordered_map<std::string, size_t> by_key_;
};

Source* ItemReader::File(const std::string& in_item, std::string* error) {
  auto it = open_.find(in_item);
  if (it == open_.end()) {
    it = open_.emplace(in_item, files_.Open(Rel(in_item), /*parse=*/false)).first;
    by_file_[it->second->file.v] = it->second.get();
  }
  if (it->second->fd < 0) {
    *error = it->second->error.empty() ? "cannot open " + Rel(in_item) : it->second->error;
    return nullptr;
  }
  return it->second.get();
}

Result<std::string> ItemReader::ReadValue(const Stored& s, uint64_t off, uint64_t len) {
  if (s.inline_value != nullptr) {
    const std::string& b = s.inline_value->bytes;
    if (off > b.size() || len > b.size() - off) return Invalid("a range past an inline value");
    return b.substr(off, len);
  }
  const SourceFile& sf = ck_.files[s.file.v];
  if (off > s.length || len > s.length - off) return Invalid("a range past the value");
  std::string out(len, '\0');
  auto it = by_file_.find(s.file.v);
  Source* src = it == by_file_.end() ? nullptr : it->second;
  if (src == nullptr || src->fd < 0) return IoError("cannot read " + sf.rel_path);
  RETURN_IF_ERROR(PreadExact(src->fd, s.offset + off, out.data(), len, sf.rel_path));
  return out;
}

bool ItemReader::Lookup(const std::string& key, Stored* out) {
  *out = Stored{};
  if (ocdbt_) {
    auto it = by_key_.find(key);
    if (it == by_key_.end()) return false;
    const orbax::OcdbtValue& v = listing_.values[it->second];
    std::string error;
    Source* src = File(v.file, &error);
    if (src == nullptr) return false;
    out->file = src->file;
    if (v.is_inline) {
      out->inline_value = &v;
    } else {
      out->offset = v.offset;
      out->length = v.length;
    }
    return true;
  }
  if (!IsFile(Abs(key))) return false;
  std::string error;
  Source* src = File(key, &error);
  if (src == nullptr) return false;
  out->file = src->file;
  out->length = ck_.files[src->file.v].size;
  return true;
}

uint64_t ItemReader::StoredChunks(const std::string& name, uint64_t cap) const {
  const std::string prefix = name + "/";
  uint64_t n = 0;
  if (ocdbt_) {
    auto it = std::lower_bound(listing_.values.begin(), listing_.values.end(), prefix,
                               [](const orbax::OcdbtValue& v, const std::string& k) { return v.key < k; });
    for (; it != listing_.values.end() && n <= cap && it->key.compare(0, prefix.size(), prefix) == 0; ++it) ++n;
    return n;
  }
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(Abs(name), fs::directory_options::none, ec);
       !ec && it != fs::recursive_directory_iterator() && n <= cap; it.increment(ec)) {
    if (it->is_regular_file(ec)) ++n;
  }
  return n;
}

Result<std::string> ItemReader::ArrayMetadataText(const std::string& name, bool* v3) {
  Stored s;
  for (const char* meta : {"/.zarray", "/zarr.json"}) {
    if (!Lookup(name + meta, &s)) continue;
    *v3 = std::string_view(meta) == "/zarr.json";
    const uint64_t len = s.inline_value ? s.inline_value->length : s.length;
    if (len > (uint64_t{1} << 20)) return Invalid(Rel(name + meta) + " is larger than 1 MiB");
    return ReadValue(s, 0, len);
  }
  return NotFound("no .zarray or zarr.json for '" + name + "'");
}

// The fragments of one stored chunk (a shard: its inner chunks) whose grid
// origin (elements) is `origin`.
Status ItemReader::ChunkFragments(const ZarrArray& a, const Stored& s, const std::string& where,
                                  const std::vector<int64_t>& origin, std::vector<Fragment>* frags) {
  const std::vector<int64_t>& cs = a.sharded ? a.inner : a.chunks;
  const auto strides = ContiguousStrides(cs);
  const uint64_t value_len = s.inline_value ? s.inline_value->length : s.length;
  if (s.inline_value == nullptr) {
    const SourceFile& sf = ck_.files[s.file.v];
    if (s.offset > sf.size || value_len > sf.size - s.offset) {
      return Invalid(where + " is bytes [" + std::to_string(s.offset) + ", +" + std::to_string(value_len) + ") of " +
                     sf.rel_path + ", which has " + std::to_string(sf.size) + " (truncated?)");
    }
  }
  // One payload [off, +len) of the stored value -> one fragment at `at`.
  auto add = [&](uint64_t off, uint64_t len, const std::vector<int64_t>& at) -> Status {
    Fragment f;
    f.file = s.file;
    f.dtype = a.dtype;
    f.strides = strides;
    f.data_length = a.InnerChunkBytes();
    for (size_t d = 0; d < at.size(); ++d) {
      f.offsets.push_back(at[d]);
      f.lengths.push_back(std::min(cs[d], a.shape[d] - at[d]));
      if (f.lengths.back() <= 0) return Status::Ok();  // an inner chunk past the array's edge
    }
    if (!a.zstd) {
      if (len != f.data_length) {
        return Invalid(where + " holds " + std::to_string(len) + " bytes, an uncompressed chunk needs " +
                       std::to_string(f.data_length));
      }
      if (s.inline_value != nullptr) {
        const orbax::OcdbtValue& v = *s.inline_value;
        if (v.node_zstd) return Unsupported(where + ": an uncompressed chunk stored inline in a compressed OCDBT node");
        f.data_offset = v.node_offset + v.node_header + v.body_offset + off;
      } else {
        f.data_offset = s.offset + off;
      }
    } else if (s.inline_value != nullptr) {
      const orbax::OcdbtValue& v = *s.inline_value;
      if (v.node_zstd) {
        f.compression = Compression::kZstdNested;
        f.item_offset = v.node_offset + v.node_header;
        f.item_length = v.node_length - v.node_header - 4;
        f.inner_offset = v.body_offset + off;
        f.inner_length = len;
      } else {
        f.compression = Compression::kZstd;
        f.item_offset = v.node_offset + v.node_header + v.body_offset + off;
        f.item_length = len;
      }
    } else {
      f.compression = Compression::kZstd;
      f.item_offset = s.offset + off;
      f.item_length = len;
    }
    frags->push_back(std::move(f));
    return Status::Ok();
  };
  if (!a.sharded) return add(0, value_len, origin);
  const uint64_t ib = a.ShardIndexBytes();
  if (value_len < ib) return Invalid(where + " is shorter than its shard index");
  ASSIGN_OR_RETURN(std::string index, ReadValue(s, a.index_at_end ? value_len - ib : 0, ib));
  auto entries = orbax::DecodeShardIndex(a, index, value_len);
  if (!entries.ok()) return entries.status().Annotate(where);
  std::vector<int64_t> per(a.chunks.size()), idx(a.chunks.size(), 0);
  for (size_t d = 0; d < per.size(); ++d) per[d] = a.chunks[d] / a.inner[d];
  for (const orbax::ShardEntry& e : *entries) {
    std::vector<int64_t> at(origin);
    for (size_t d = 0; d < at.size(); ++d) at[d] += idx[d] * a.inner[d];
    bool inside = true;
    for (size_t d = 0; d < at.size(); ++d) inside = inside && at[d] < a.shape[d];
    if (e.absent && inside) {
      return Unsupported(where + ": inner chunk at " + JsonText(json(at)) +
                         " is marked empty (the array's fill_value " + a.fill_value +
                         "); ckptfs does not synthesize fill values");
    }
    if (!e.absent) RETURN_IF_ERROR(add(e.offset, e.nbytes, at));
    for (size_t d = idx.size(); d-- > 0;) {
      if (++idx[d] < per[d]) break;
      idx[d] = 0;
    }
  }
  return Status::Ok();
}

void ItemReader::ReadArray(const Leaf& leaf, const Result<std::string>& text, bool v3,
                           std::vector<std::vector<std::string>>* paths) {
  TensorRecord t;
  t.key = label_.empty() ? leaf.name : label_ + "/" + leaf.name;
  t.encoding = Encoding::kTensor;
  std::vector<Fragment> frags;
  auto finish = [&] {
    if (t.dtype == DType::kInvalid) t.dtype = DType::kU8;
    if (!t.error.empty()) {
      ck_.info.problems.push_back(t.error);
      frags.clear();
    }
    ck_.AddTensor(std::move(t), std::move(frags));
    std::vector<std::string> p;
    if (!label_.empty()) p.push_back(label_);
    p.insert(p.end(), leaf.path.begin(), leaf.path.end());
    paths->push_back(std::move(p));
  };
  if (!text.ok()) {
    t.error = "cannot read array '" + leaf.name + "' of " + (item_rel_.empty() ? "." : item_rel_) + ": " +
              text.status().message();
    return finish();
  }
  auto meta = orbax::ParseZarrMetadata(*text);
  if (!meta.ok()) {
    t.error = "cannot read " + Rel(leaf.name + (v3 ? "/zarr.json" : "/.zarray")) + ": " + meta.status().message();
    return finish();
  }
  const ZarrArray& a = *meta;
  t.dtype = a.dtype;
  t.shape = a.shape;
  std::vector<int64_t> grid(a.shape.size());
  uint64_t n = 1;
  for (size_t d = 0; d < grid.size(); ++d) {
    grid[d] = a.shape[d] / a.chunks[d] + (a.shape[d] % a.chunks[d] != 0);
    if (MulOverflow(n, static_cast<uint64_t>(grid[d]), &n) || n > kMaxChunksPerArray) {
      t.error = "cannot read array '" + leaf.name + "': its shape " + JsonText(json(a.shape)) + " in chunks of " +
                JsonText(json(a.chunks)) + " is more chunks than ckptfs indexes";
      return finish();
    }
  }
  if (n > kMaxAbsentChunks) {
    const uint64_t present = StoredChunks(leaf.name, n);
    if (n > present + kMaxAbsentChunks) {
      t.error = "cannot read array '" + leaf.name + "': its shape " + JsonText(json(a.shape)) + " needs " +
                std::to_string(n) + " chunks, " + std::to_string(present) + " are stored (a damaged zarr metadata?)";
      return finish();
    }
  }
  std::vector<int64_t> idx(grid.size(), 0);
  std::vector<std::string> holes;
  for (uint64_t c = 0; c < n; ++c) {
    const std::string key = leaf.name + "/" + a.ChunkKey(idx);
    std::vector<int64_t> origin(idx.size());
    for (size_t d = 0; d < idx.size(); ++d) origin[d] = idx[d] * a.chunks[d];
    Stored s;
    if (!Lookup(key, &s)) {
      std::vector<int64_t> len(idx.size());
      for (size_t d = 0; d < idx.size(); ++d) len[d] = std::min(a.chunks[d], a.shape[d] - origin[d]);
      holes.push_back(BoxString(Box{origin, len}));
      if (holes.size() == 1) {
        ck_.info.Flag(Check::kCoverage, Severity::kError, t.key, Rel(key),
                      "orbax chunk " + Rel(key) + (ocdbt_ ? " is not in the OCDBT database" : " is missing") +
                          ": a hole at " + holes.back() + " of '" + t.key +
                          "' (reads of that region fail; ckptfs never fills it with fill_value)",
                      json({{"holes", {holes.back()}}, {"shape", a.shape}}).dump());
      }
    } else if (Status st = ChunkFragments(a, s, Rel(key), origin, &frags); !st.ok()) {
      t.error = "cannot read array '" + leaf.name + "': " + st.message();
      return finish();
    }
    for (size_t d = idx.size(); d-- > 0;) {
      if (++idx[d] < grid[d]) break;
      idx[d] = 0;
    }
  }
  if (holes.size() > 1) {
    ck_.info.findings.back().message += " (and " + std::to_string(holes.size() - 1) + " more missing chunks)";
  }
  finish();
}

Status ItemReader::Read(std::vector<std::vector<std::string>>* paths, std::string* note, orbax::Sharding* sharding) {
  json top;
  ASSIGN_OR_RETURN(std::vector<Leaf> leaves, ReadTreeMetadata(Abs("_METADATA"), &top));
  ocdbt_ = IsFile(Abs("manifest.ocdbt"));
  std::string storage = "zarr";
  if (ocdbt_) {
    orbax::OcdbtFiles io;
    io.size_of = [this](const std::string& rel) -> Result<uint64_t> {
      if (!orbax::SafeRelativePath(rel)) return Invalid("data file path '" + rel + "' leaves the item directory");
      std::string error;
      Source* src = File(rel, &error);
      if (src == nullptr) return IoError(error);
      return ck_.files[src->file.v].size;
    };
    io.read = [this](const std::string& rel, uint64_t off, uint64_t len) -> Result<std::string> {
      std::string error;
      Source* src = File(rel, &error);
      if (src == nullptr) return IoError(error);
      std::string out(len, '\0');
      RETURN_IF_ERROR(PreadExact(src->fd, off, out.data(), len, Rel(rel)));
      return out;
    };
    auto listing = orbax::ReadOcdbt(io, "manifest.ocdbt");
    if (!listing.ok())
      return listing.status().Annotate("cannot read the OCDBT database of " +
                                       (item_rel_.empty() ? std::string(".") : item_rel_));
    listing_ = std::move(listing).value();
    for (size_t i = 0; i < listing_.values.size(); ++i) by_key_.emplace(listing_.values[i].key, i);
    storage = "OCDBT (generation " + std::to_string(listing_.generation) + ", " +
              std::to_string(listing_.values.size()) + " keys) + zarr";
  }
  size_t arrays = 0, v3_arrays = 0;
  const size_t first_record = ck_.tensors.size();
  std::set<std::string> unread;
  for (const Leaf& leaf : leaves) {
    if (leaf.skip || leaf.value_type == "None") continue;  // optax EmptyState: no array written
    bool v3 = false;
    const auto text = ArrayMetadataText(leaf.name, &v3);
    if (!text.ok() && text.status().code() == Code::kNotFound) {
      unread.insert(leaf.value_type.empty() ? leaf.name : leaf.name + " (" + leaf.value_type + ")");
      continue;
    }
    ++arrays;
    v3_arrays += v3;
    ReadArray(leaf, text, v3, paths);
  }
  // topo/ split rules from the PartitionSpecs (a record keeps its own name's).
  *sharding = orbax::ReadSharding(Abs("_sharding"));
  const auto& splits = sharding->splits;
  for (size_t i = first_record; i < ck_.tensors.size(); ++i) {
    TensorRecord& t = ck_.tensors[i];
    auto it = splits.find(label_.empty() ? t.key : t.key.substr(label_.size() + 1));
    if (it != splits.end() &&
        (it->second.kind != SplitKind::kDim || it->second.dim < static_cast<int>(t.shape.size()))) {
      t.split = it->second;
    }
  }
  storage += v3_arrays == 0 ? " v2" : v3_arrays == arrays ? " v3" : " v2/v3";
  *note = storage;
  if (!unread.empty()) {
    std::string list;
    size_t i = 0;
    for (const std::string& u : unread) {
      if (i++ == 8) {
        list += ", and " + std::to_string(unread.size() - 8) + " more";
        break;
      }
      list += (i > 1 ? ", " : "") + u;
    }
    ck_.info.problems.push_back(std::to_string(unread.size()) + " pytree leaves of " + Rel("_METADATA") +
                                " have no array (not read): " + list);
  }
  // Orbax's own metadata, verbatim under other/.
  for (const char* f : {"_METADATA", "_sharding"}) {
    if (!IsFile(Abs(f))) continue;
    auto src = files_.Open(Rel(f), /*parse=*/false);
    TensorRecord t;
    t.key = label_.empty() ? f : label_ + "/" + f;
    t.error = src->error;
    t.raw_bytes = true;  // JSON
    ck_.AddFileBytes(src->file, std::move(t));
    std::vector<std::string> p;
    if (!label_.empty()) p.push_back(label_);
    p.push_back(f);
    paths->push_back(std::move(p));
  }
  return Status::Ok();
}

uint32_t ProcessCount(const std::string& item_dir) {
  uint32_t n = 0;
  for (const std::string& f : ListDirectory(item_dir + "/array_metadatas")) n += f.rfind("process_", 0) == 0;
  if (n == 0) {
    for (const std::string& f : ListDirectory(item_dir)) n += f.rfind("ocdbt.process_", 0) == 0;
  }
  return n;
}

}  // namespace

bool LooksLikeOrbax(const std::string& dir) {
  // An unfinished save (`<step>.orbax-checkpoint-tmp*`, or an item inside
  // one) is never read: not even recognised, so nothing is written into it.
  std::string d = dir;
  while (d.size() > 1 && d.back() == '/') d.pop_back();
  const fs::path p(d);
  for (const fs::path& part : {p.filename(), p.parent_path().filename()}) {
    if (part.string().find(kTmpMark) != std::string::npos) return false;
  }
  if (IsItemDir(dir) || IsStepDir(dir)) return true;
  for (const std::string& n : ListDirectory(dir)) {
    if (n.find(kTmpMark) == std::string::npos && StepNumber(n) >= 0 && IsStepDir(dir + "/" + n)) return true;
  }
  return false;
}

Result<Checkpoint> ReadOrbax(const std::string& dir) {
  ASSIGN_OR_RETURN(Layout l, Discover(dir));
  Checkpoint ck;
  ck.info.family = Family::kOrbax;
  Files files;
  files.dir = dir;
  files.ck = &ck;
  const bool several = l.items.size() > 1;
  std::vector<std::vector<std::string>> paths;
  std::string notes;
  orbax::Sharding first_sharding;  // the first item's: checkpoint.json's mesh
  for (const std::string& item : l.items) {
    const std::string label = several ? item.substr(item.find_last_of('/') + 1) : "";
    ItemReader r(files, item, label);
    std::string note;
    orbax::Sharding sharding;
    RETURN_IF_ERROR(r.Read(&paths, &note, &sharding));
    if (item == l.items.front()) first_sharding = std::move(sharding);
    notes += (notes.empty() ? "" : "; ") + (several ? label + ": " : "") + note;
  }
  orbax::ClassifyPytree(ck.tensors, paths);
  const std::string step_dir = l.step_rel.empty() ? dir : dir + "/" + l.step_rel;
  const std::string first_item = l.items.front().empty() ? dir : dir + "/" + l.items.front();
  if (l.step >= 0) {
    ck.info.step = l.step;
  } else {  // a step directory's number, or an item directory's step's
    const fs::path p(dir);
    ck.info.step = StepNumber((l.items.front().empty() ? p.parent_path().filename() : p.filename()).string());
  }
  if (IsFile(step_dir + "/_CHECKPOINT_METADATA") && !l.items.front().empty()) {
    auto src = files.Open(l.step_rel.empty() ? "_CHECKPOINT_METADATA" : l.step_rel + "/_CHECKPOINT_METADATA", false);
    TensorRecord t;
    t.key = t.fqn = "_CHECKPOINT_METADATA";
    t.error = src->error;
    t.raw_bytes = true;  // JSON
    ck.AddFileBytes(src->file, std::move(t));
  }
  const std::string& mesh = first_sharding.mesh;
  const uint32_t devices = first_sharding.devices;
  ck.info.world_size = std::max<uint32_t>(ProcessCount(first_item), 1);
  ck.info.format_note = "orbax-checkpoint: " + notes;
  if (!mesh.empty()) {
    ck.info.format_note += "; mesh " + mesh + " (" + std::to_string(devices) + " devices, " +
                           std::to_string(ck.info.world_size) + " process" + (ck.info.world_size > 1 ? "es" : "") + ")";
  }
  if (!l.other_steps.empty()) {
    std::string list;
    for (const std::string& s : l.other_steps) list += (list.empty() ? "" : ", ") + s;
    ck.info.problems.push_back("orbax steps " + list + " are in this directory too: this mount reads the latest, " +
                               l.step_rel + " (mount a step directory to read another)");
  }
  if (!l.unfinished.empty()) {
    std::string list;
    for (const std::string& s : l.unfinished) list += (list.empty() ? "" : ", ") + s;
    ck.info.problems.push_back("unfinished orbax saves are never read: " + list);
  }
  return ck;
}

}  // namespace ckptfs::formats

#include "formats/dcp/dcp_reader.h"

#include <dirent.h>
#include <re2/re2.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "ckptfs/formats.h"
#include "ckptfs/geometry.h"
#include "ckptfs/progress.h"
#include "common/json_text.h"
#include "common/varint.h"
#include "formats/byte_reader.h"
#include "formats/pickle.h"
#include "formats/safetensors/safetensors_header.h"
#include "formats/state_dict_roles.h"
#include "formats/tiling.h"
#include "formats/torch_save.h"
#include "formats/zstd.h"

namespace ckptfs::formats {
namespace {

// torch.save framing around a tensor chunk's bytes inside a DCP item (ZIP
// headers, data.pkl, version records): a tensor item that decompresses past
// its chunk's bytes plus this is refused before it can exhaust memory.
constexpr uint64_t kTorchSaveSlack = uint64_t{1} << 20;

struct ItemLoc {
  uint32_t file = 0;
  bool zstd = false;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// A chunk's storage key: the tensor's interned id and its offsets, as
// varints (zigzag): self-delimiting, and short enough for the string's inline
// buffer in the common case (millions of chunks, one key each).
std::string ChunkKey(uint32_t fqn_id, const int64_t* offsets, size_t n) {
  std::string k;
  PutVarint(k, fqn_id);
  for (size_t i = 0; i < n; ++i) PutVarint(k, ZigZag(offsets[i]));
  return k;
}

// One tensor chunk or bytes item to resolve against its data file.
struct Work {  // one per chunk: kept small (a checkpoint may have millions)
  uint32_t tensor = 0;
  uint32_t ndim = 0;
  bool bytes = false;
  // The chunk's offsets then sizes: `ndim` each, from here in the box pool.
  uint64_t box = 0;
  ItemLoc loc;
};

struct OpenFiles {
  std::vector<int> fds;  // -1: could not open (errors[i] says why)
  std::vector<std::string> errors;
  ~OpenFiles() {
    for (int fd : fds) {
      if (fd >= 0) ::close(fd);
    }
  }
};

Result<DType> PropertiesDType(const PyValue* props) {
  if (props == nullptr) return Invalid("tensor properties missing");
  const PyValue* dt = nullptr;
  if (props->state && props->state->kind == PyKind::kTuple && !props->state->items.empty()) {
    dt = props->state->items[0];  // (dtype, layout, requires_grad, memory_format, pin_memory)
  } else {
    dt = props->Attr("dtype");
  }
  if (dt == nullptr || dt->kind != PyKind::kGlobal) return Invalid("tensor properties carry no dtype");
  DType d = DTypeFromTorchName(dt->name());
  if (d == DType::kInvalid) return Unsupported("unsupported dtype torch." + dt->name());
  return d;
}

std::vector<std::string> PathOf(const PyValue* planner, const std::string& key) {
  std::vector<std::string> path;
  const PyValue* p = planner != nullptr && planner->kind == PyKind::kDict ? planner->Get(key) : nullptr;
  if (p != nullptr && p->IsSeq()) {
    for (const auto& e : p->items) {
      if (e->kind == PyKind::kStr)
        path.push_back(e->s);
      else if (e->kind == PyKind::kInt)
        path.push_back(std::to_string(e->i));
      else
        path.push_back("?");
    }
  }
  if (path.empty()) path.push_back(key);
  return path;
}

Result<std::string> ReadItem(int fd, const ItemLoc& loc, const std::string& name) {
  if (loc.length > GetReadLimits().max_item_bytes) {
    return Invalid("cannot read " + name + ": compressed item of " + std::to_string(loc.length) +
                   " bytes is more than --max-item-bytes (" + std::to_string(GetReadLimits().max_item_bytes) + ")");
  }
  FileSliceReader r(fd, loc.offset, loc.length, name);
  return r.ReadAt(0, loc.length);
}

// DCP's SAFETENSORS serialization (FileSystemWriter(serialization_format=
// SAFETENSORS)): a rank file's tensors are one safetensors blob after its
// bytes items, and every tensor's _StorageInfo points at the blob's start
// (length: the tensor's bytes). Each blob's header is parsed once, by the
// first chunk that needs it, and shared by the resolver threads.
struct StBlock {
  std::once_flag once;
  Status status;
  std::unordered_map<std::string, SafetensorsEntry> entries;
  std::map<std::string, std::vector<int64_t>> saved_offsets;  // DCP_SHARDING_INFO
};
class StBlocks {
 public:
  std::shared_ptr<StBlock> Get(uint32_t file, uint64_t offset) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& b = blocks_[{file, offset}];
    if (!b) b = std::make_shared<StBlock>();
    return b;
  }

 private:
  std::mutex mu_;
  std::map<std::pair<uint32_t, uint64_t>, std::shared_ptr<StBlock>> blocks_;
};

Result<Fragment> ResolveSafetensorsChunk(const Work& w, Fragment f, const TensorRecord& t, int fd,
                                         const std::string& file_name, uint64_t file_size, StBlocks& blocks) {
  const std::string name = file_name + " (safetensors block @ " + std::to_string(w.loc.offset) + ")";
  std::shared_ptr<StBlock> b = blocks.Get(w.loc.file, w.loc.offset);
  std::call_once(b->once, [&] {
    auto h = ReadSafetensorsHeader(fd, w.loc.offset, file_size, name);
    if (!h.ok()) {
      b->status = h.status();
      return;
    }
    auto sharding = DcpShardingInfo(*h, name);
    if (!sharding.ok()) {
      b->status = sharding.status();
      return;
    }
    b->saved_offsets = std::move(*sharding);
    for (SafetensorsEntry& e : h->entries) b->entries.emplace(e.name, std::move(e));
  });
  RETURN_IF_ERROR(b->status);
  auto it = b->entries.find(t.key);
  if (it == b->entries.end()) return Invalid("cannot read " + name + ": no tensor '" + t.key + "' in it");
  const SafetensorsEntry& e = it->second;
  if (e.dtype != t.dtype || e.shape != f.lengths) {
    return Invalid("cannot read " + name + ": '" + t.key + "' is " + std::string(DTypeName(e.dtype)) + " " +
                   ShapeStr(e.shape) + " there, .metadata's chunk is " + std::string(DTypeName(t.dtype)) + " " +
                   ShapeStr(f.lengths));
  }
  if (e.end - e.begin != w.loc.length) {
    return Invalid("cannot read " + name + ": '" + t.key + "' has " + std::to_string(e.end - e.begin) +
                   " bytes there, .metadata says " + std::to_string(w.loc.length));
  }
  if (auto so = b->saved_offsets.find(t.key); so != b->saved_offsets.end() && so->second != f.offsets) {
    return Invalid("cannot read " + name + ": DCP_SHARDING_INFO puts '" + t.key + "' at " + ShapeStr(so->second) +
                   ", .metadata's chunk at " + ShapeStr(f.offsets));
  }
  f.dtype = e.dtype;
  f.strides = ContiguousStrides(e.shape);
  f.data_offset = e.begin;
  f.data_length = e.end - e.begin;
  return f;
}

// Resolves one chunk: parses its torch.save item (or finds it in its file's
// safetensors block), checks it against the
// metadata and returns the fragment (or a per-tensor error).
// `box`: the chunk's offsets then sizes (w.ndim each).
Result<Fragment> ResolveChunk(const Work& w, const int64_t* box, const TensorRecord& t, int fd,
                              const std::string& file_name, uint64_t file_size, StBlocks& st_blocks,
                              std::vector<ChecksumRange>* sums) {
  const std::string name = file_name + " @ " + std::to_string(w.loc.offset);
  Fragment f;
  f.file = FileId{w.loc.file};
  f.offsets.assign(box, box + w.ndim);
  f.lengths.assign(box + w.ndim, box + 2 * w.ndim);
  if (w.bytes) {
    f.data_offset = w.loc.offset;
    f.data_length = w.loc.length;
    if (w.loc.zstd) {
      // Only the size is needed: counted while streaming (1 MiB of input at a
      // time), bounded by --max-item-bytes, never held whole.
      if (w.loc.length > GetReadLimits().max_item_bytes) {
        return Invalid("cannot read " + name + ": compressed item of " + std::to_string(w.loc.length) +
                       " bytes is more than --max-item-bytes (" + std::to_string(GetReadLimits().max_item_bytes) + ")");
      }
      FileSliceReader r(fd, w.loc.offset, w.loc.length, name);
      auto input = [&r](uint64_t off, uint64_t n, char* dst) -> Status {
        ASSIGN_OR_RETURN(std::string piece, r.ReadAt(off, n));
        std::memcpy(dst, piece.data(), piece.size());
        return Status::Ok();
      };
      ASSIGN_OR_RETURN(uint64_t size, ZstdCountDecompressed(input, w.loc.length, GetReadLimits().max_item_bytes, name));
      f.compression = Compression::kZstd;
      f.item_offset = w.loc.offset;
      f.item_length = w.loc.length;
      f.data_offset = 0;
      f.data_length = size;
    }
    return f;
  }
  std::string plain;
  std::unique_ptr<ByteReader> reader;
  if (w.loc.zstd) {
    ASSIGN_OR_RETURN(std::string raw, ReadItem(fd, w.loc, name));
    uint64_t bound = DTypeSize(t.dtype);
    for (int64_t d : f.lengths) {
      if (d < 0 || MulOverflow(bound, static_cast<uint64_t>(d), &bound))
        return Invalid("cannot read " + name + ": bad chunk size");
    }
    bound = std::min(bound + kTorchSaveSlack, GetReadLimits().max_item_bytes);
    ASSIGN_OR_RETURN(plain, ZstdDecompress(raw, bound, name));
    reader = std::make_unique<MemoryReader>(plain, name + " (zstd)");
  } else {
    reader = std::make_unique<FileSliceReader>(fd, w.loc.offset, w.loc.length, name);
  }
  auto archive = ReadTorchSave(*reader);
  if (!archive.ok()) {
    if (!w.loc.zstd && LooksLikeSafetensorsAt(fd, w.loc.offset, file_size)) {
      return ResolveSafetensorsChunk(w, std::move(f), t, fd, file_name, file_size, st_blocks);
    }
    return archive.status();
  }
  TorchSaveArchive& a = *archive;
  if (a.root->kind != PyKind::kTensor) return Invalid("cannot read " + name + ": item is not a tensor");
  const TensorRef& ref = a.root->tensor();
  if (ref.shape != f.lengths)
    return Invalid("cannot read " + name + ": item's shape differs from the chunk in .metadata");
  if (ref.dtype != t.dtype) {
    return Invalid("cannot read " + name + ": item dtype " + std::string(DTypeName(ref.dtype)) +
                   " differs from .metadata's " + std::string(DTypeName(t.dtype)));
  }
  ASSIGN_OR_RETURN(ResolvedTensor rt, ResolveTensor(*reader, a, ref));
  if (!w.loc.zstd) AppendZipChecksums(*reader, a, f.file, w.loc.offset, sums);
  f.dtype = ref.dtype;
  f.strides = ref.strides;
  f.data_length = rt.data_length;
  if (w.loc.zstd) {
    f.compression = Compression::kZstd;
    f.item_offset = w.loc.offset;
    f.item_length = w.loc.length;
    f.data_offset = rt.data_offset;
  } else {
    f.data_offset = w.loc.offset + rt.data_offset;
  }
  return f;
}

// The training step, from the usual keys or the directory name; -1 if unknown.
int64_t FindStep(const std::string& dir, const Checkpoint& ck, const OpenFiles& files) {
  for (const char* key : {"train_state.step", "step", "iteration", "global_step", "train_state.iteration"}) {
    for (size_t i = 0; i < ck.tensors.size(); ++i) {
      const TensorRecord& t = ck.tensors[i];
      if (t.key != key || !t.error.empty() || ck.fragments.Count(i) != 1) continue;
      const Fragment f = ck.fragments.Get(i)[0];
      int fd = files.fds[f.file.v];
      if (fd < 0) continue;
      if (t.encoding == Encoding::kBytes && f.compression == Compression::kNone) {
        FileSliceReader r(fd, f.data_offset, f.data_length, t.key);
        auto a = ReadTorchSave(r);
        if (a.ok() && a->root->kind == PyKind::kInt) return a->root->i;
      } else if (t.encoding == Encoding::kTensor && t.shape.empty() && f.compression == Compression::kNone) {
        char buf[8] = {};
        size_t n = DTypeSize(t.dtype);
        if (n == 0 || n > 8 || ::pread(fd, buf, n, static_cast<off_t>(f.data_offset)) != static_cast<ssize_t>(n))
          continue;
        if (t.dtype == DType::kI64) return LoadLE<int64_t>(buf);
        if (t.dtype == DType::kI32) return LoadLE<int32_t>(buf);
        if (t.dtype == DType::kF32) return static_cast<int64_t>(LoadLE<float>(buf));
        if (t.dtype == DType::kF64) return static_cast<int64_t>(LoadLE<double>(buf));
      }
    }
  }
  std::string base = dir;
  while (!base.empty() && base.back() == '/') base.pop_back();
  base = base.substr(base.rfind('/') + 1);
  static const RE2 kStepRe(R"((?:step|global_step|iter|checkpoint)[-_]?0*([0-9]+)$)");
  int64_t step = -1;
  if (RE2::PartialMatch(base, kStepRe, &step)) return step;
  return -1;
}

// One DCP save inside the mounted directory: its folder ("" or "<sub>/")
// and metadata files: {".metadata"} for a global save, else the rank-local
// `__<rank>.metadata` files (dcp.save(use_collectives=False)) in rank order.
struct DcpSave {
  std::string prefix;
  std::vector<std::pair<uint32_t, std::string>> meta;  // (rank, file name)
  std::set<uint32_t> data_ranks;                       // ranks of its __<rank>_<n>.distcp files
  bool rank_local() const { return !meta.empty() && meta[0].second != ".metadata"; }
};

DcpSave FindSave(const std::string& dir, const std::string& prefix) {
  DcpSave save;
  save.prefix = prefix;
  const std::string d = prefix.empty() ? dir : dir + "/" + prefix;
  struct stat st {};
  if (::stat((d + "/.metadata").c_str(), &st) == 0) {
    save.meta = {{0, ".metadata"}};
    return save;
  }
  static const RE2 kMetaRe(R"(__([0-9]{1,9})\.metadata)");
  static const RE2 kDataRe(R"(__([0-9]{1,9})_[0-9]+(?:\.distcp)?)");
  for (const std::string& name : ListDirectory(d)) {
    uint32_t rank = 0;
    if (RE2::FullMatch(name, kMetaRe, &rank)) save.meta.emplace_back(rank, name);
    if (RE2::FullMatch(name, kDataRe, &rank)) save.data_ranks.insert(rank);
  }
  std::sort(save.meta.begin(), save.meta.end());
  return save;
}

// The DCP saves that make up the checkpoint at `dir`: the directory itself,
// or Accelerate's FSDP layout (what HF Trainer's checkpoint-N/ holds with
// SHARDED_STATE_DICT): the model in pytorch_model_fsdp_0/ and its optimizer
// in optimizer_0/, two DCP saves read as one checkpoint. Empty when none.
std::vector<DcpSave> FindSaves(const std::string& dir) {
  DcpSave top = FindSave(dir, "");
  if (!top.meta.empty()) return {top};
  std::vector<DcpSave> out;
  for (const char* sub : {"pytorch_model_fsdp_0/", "optimizer_0/"}) {
    DcpSave s = FindSave(dir, sub);
    if (!s.meta.empty()) out.push_back(std::move(s));
  }
  if (!out.empty() && out[0].prefix != "pytorch_model_fsdp_0/") out.clear();  // an optimizer without its model
  return out;
}

}  // namespace

bool LooksLikeDcp(const std::string& dir) { return !FindSaves(dir).empty(); }

Result<Checkpoint> ReadDcp(const std::string& dir) {
  const std::vector<DcpSave> saves = FindSaves(dir);
  if (saves.empty()) return NotFound("cannot read " + dir + ": no .metadata and no __<rank>.metadata");
  size_t n_meta = 0;
  for (const DcpSave& sv : saves) n_meta += sv.meta.size();
  // Several metadata files: their entries are merged by key.
  const bool merge = n_meta > 1;
  std::string meta_path;  // the metadata file being parsed, for errors
  auto fail = [&](const Status& s) { return s.Annotate("cannot parse " + meta_path); };

  Checkpoint ck;
  // Source files: the metadata files first, then every data file in
  // storage_data order.
  std::map<std::string, uint32_t> file_ids;
  auto add_file = [&](const std::string& rel) {
    auto [it, inserted] = file_ids.emplace(rel, static_cast<uint32_t>(ck.files.size()));
    if (inserted) ck.files.push_back(SourceFile{rel, 0, 0, 0});
    return it->second;
  };
  for (const DcpSave& sv : saves) {
    for (const auto& [rank, name] : sv.meta) add_file(sv.prefix + name);
  }
  std::string cur_prefix;  // the folder of the save being parsed

  // storage_data: MetadataIndex(fqn, offset) -> _StorageInfo(file, offset, length).
  std::unordered_map<std::string, ItemLoc> items;
  std::unordered_map<std::string, uint32_t> fqn_ids;  // tensor name -> id in the keys
  auto fqn_id = [&](const std::string& fqn) {
    return fqn_ids.emplace(fqn, static_cast<uint32_t>(fqn_ids.size())).first->second;
  };
  auto add_storage = [&](const PyValue& k, const PyValue& v) -> Status {
    if (k.ClassName() != "MetadataIndex" || v.ClassName() != "_StorageInfo") {
      return Invalid("cannot parse " + meta_path + ": storage_data entry is not MetadataIndex -> _StorageInfo");
    }
    const PyValue* fqn = k.Attr("fqn");
    const PyValue* off = k.Attr("offset");
    if (fqn == nullptr || !fqn->IsStr()) return Invalid("cannot parse " + meta_path + ": MetadataIndex without fqn");
    std::vector<int64_t> offsets;
    if (off != nullptr && off->kind != PyKind::kNone) {
      auto o = AsIntVector(off, "MetadataIndex.offset");
      if (!o.ok()) return fail(o.status());
      offsets = *o;
    }
    const PyValue* rel = v.Attr("relative_path");
    if (rel == nullptr || !rel->IsStr())
      return Invalid("cannot parse " + meta_path + ": _StorageInfo without relative_path");
    if (rel->s.empty() || rel->s.find("..") != std::string::npos || rel->s[0] == '/') {
      return Invalid("cannot parse " + meta_path + ": unsafe relative_path '" + rel->s + "'");
    }
    ItemLoc loc;
    loc.file = add_file(cur_prefix + rel->s);
    auto o = AsInt(v.Attr("offset"), "_StorageInfo.offset");
    auto l = AsInt(v.Attr("length"), "_StorageInfo.length");
    if (!o.ok() || !l.ok() || *o < 0 || *l < 0)
      return Invalid("cannot parse " + meta_path + ": bad _StorageInfo offset/length");
    loc.offset = static_cast<uint64_t>(*o);
    loc.length = static_cast<uint64_t>(*l);
    if (const PyValue* td = v.Attr("transform_descriptors"); td != nullptr && td->IsSeq()) {
      for (const auto& d : td->items) {
        if (d->IsStr() && d->s.rfind("stream.zstd", 0) == 0) {
          loc.zstd = true;
        } else if (d->IsStr()) {
          return Unsupported("cannot parse " + meta_path + ": unknown storage transform '" + d->s + "'");
        }
      }
    }
    // Rank-local saves are not deduplicated: a replicated item is in every
    // rank's metadata; the lowest rank's copy is the one read.
    items.emplace(ChunkKey(fqn_id(fqn->s), offsets.data(), offsets.size()), loc);
    return Status::Ok();
  };

  // state_dict_metadata: a tensor (its chunks become work items, located in
  // storage_data once both are read) or a bytes entry.
  std::vector<Work> work;
  std::vector<int64_t> boxes;  // Work::box
  // Rank-local saves: the same key appears in several ranks' metadata (each
  // with that rank's chunks, replicated ones in every rank); merged here.
  std::unordered_map<std::string, uint32_t> tensor_ids;
  std::unordered_set<std::string> seen_chunks;
  auto describe = [](const TensorRecord& t) {
    return t.encoding == Encoding::kBytes ? std::string("a bytes entry")
                                          : std::string(DTypeName(t.dtype)) + " " + ShapeStr(t.shape);
  };
  auto add_sdm = [&](const PyValue& k, const PyValue& md) -> Status {
    if (!k.IsStr()) return Invalid("cannot parse " + meta_path + ": non-string key in state_dict_metadata");
    TensorRecord t;
    t.key = k.s;
    size_t ti = ck.tensors.size();
    TensorRecord* earlier = nullptr;
    if (merge) {
      auto [it, inserted] = tensor_ids.emplace(t.key, static_cast<uint32_t>(ti));
      if (!inserted) {
        ti = it->second;
        earlier = &ck.tensors[ti];
      }
    }
    // A key an earlier rank's metadata gave differently: the tensor is refused.
    auto disagree = [&] {
      if (earlier->error.empty()) {
        earlier->error = "cannot index '" + t.key + "': " + meta_path + " gives it as " + describe(t) +
                         ", an earlier rank's metadata as " + describe(*earlier);
        ck.info.Flag(Check::kCoverage, Severity::kError, t.key, meta_path.substr(dir.size() + 1), earlier->error);
      }
      return Status::Ok();
    };
    std::string cls = md.ClassName();
    if (cls == "BytesStorageMetadata") {
      t.encoding = Encoding::kBytes;
      t.dtype = DType::kU8;
      if (earlier != nullptr) return earlier->encoding == Encoding::kBytes ? Status::Ok() : disagree();
      Work w;
      w.tensor = static_cast<uint32_t>(ti);
      w.bytes = true;
      work.push_back(w);
    } else if (cls == "TensorStorageMetadata") {
      t.encoding = Encoding::kTensor;
      auto dt = PropertiesDType(md.Attr("properties"));
      auto shape = AsIntVector(md.Attr("size"), "size");
      if (!dt.ok() || !shape.ok()) {
        return Invalid("cannot parse " + meta_path + ": tensor '" + t.key +
                       "': " + (!dt.ok() ? dt.status().message() : shape.status().message()));
      }
      t.dtype = *dt;
      t.shape = *shape;
      for (int64_t s : t.shape) {
        if (s < 0) return Invalid("cannot parse " + meta_path + ": tensor '" + t.key + "' has a negative size");
      }
      if (earlier != nullptr &&
          (earlier->encoding != Encoding::kTensor || earlier->dtype != t.dtype || earlier->shape != t.shape)) {
        return disagree();
      }
      if (std::string why = CheckTensorGeometry(t, {}); !why.empty()) {
        if (earlier != nullptr) return Status::Ok();  // refused with the first rank's entry
        t.error = "cannot index '" + t.key + "' (" + meta_path + "): " + why;
        t.shape.assign(1, 0);
        ck.info.problems.push_back(t.error);
        ck.tensors.push_back(std::move(t));
        return Status::Ok();
      }
      const PyValue* chunks = md.Attr("chunks");
      if (chunks == nullptr || !chunks->IsSeq())
        return Invalid("cannot parse " + meta_path + ": tensor '" + t.key + "' has no chunks");
      TensorRecord& rec = earlier != nullptr ? *earlier : t;
      for (const auto& c : chunks->items) {
        auto offs = AsIntVector(c->Attr("offsets"), "chunk offsets");
        auto sizes = AsIntVector(c->Attr("sizes"), "chunk sizes");
        if (!offs.ok() || !sizes.ok())
          return Invalid("cannot parse " + meta_path + ": tensor '" + t.key + "': bad chunk");
        if (offs->size() != t.shape.size() || sizes->size() != t.shape.size()) {
          if (rec.error.empty()) {
            rec.error = "cannot index '" + t.key + "' (" + meta_path + "): a chunk has " +
                        std::to_string(offs->size()) + " offsets and " + std::to_string(sizes->size()) +
                        " sizes for a tensor of " + std::to_string(t.shape.size()) + " dimensions";
            ck.info.Flag(Check::kCoverage, Severity::kError, t.key, meta_path.substr(dir.size() + 1), rec.error);
          }
          continue;
        }
        // Not deduplicated across ranks: a replicated chunk is read from the
        // lowest rank that lists it (as its storage item is).
        if (merge && !seen_chunks.insert(ChunkKey(fqn_id(t.key), offs->data(), offs->size())).second) continue;
        Work w;
        w.tensor = static_cast<uint32_t>(ti);
        w.ndim = static_cast<uint32_t>(t.shape.size());
        w.box = boxes.size();
        boxes.insert(boxes.end(), offs->begin(), offs->end());
        boxes.insert(boxes.end(), sizes->begin(), sizes->end());
        work.push_back(w);
      }
      if (earlier != nullptr) return Status::Ok();
      t.byte_size = t.Numel() * DTypeSize(t.dtype);
    } else {
      return Unsupported("cannot parse " + meta_path + ": unknown storage metadata class " + cls + " for '" + t.key +
                         "'");
    }
    ck.tensors.push_back(std::move(t));
    return Status::Ok();
  };

  // Each metadata file in turn (one, or one per rank when rank-local). The
  // file is read in windows by the pickle VM (it may be hundreds of MiB),
  // never held whole.
  std::vector<std::vector<std::string>> paths;                  // each tensor's state-dict path
  std::vector<std::pair<std::string, std::string>> meta_files;  // (folder, file name), in reading order
  for (const DcpSave& sv : saves) {
    for (const auto& [rank, name] : sv.meta) meta_files.emplace_back(sv.prefix, name);
  }
  for (const auto& [prefix, name] : meta_files) {
    cur_prefix = prefix;
    meta_path = dir + "/" + prefix + name;
    uint64_t meta_size = 0;
    auto meta_fd = OpenBoundedFile(meta_path, GetReadLimits().max_metadata_bytes, &meta_size);
    if (!meta_fd.ok()) return meta_fd.status();
    struct CloseFd {
      int fd;
      ~CloseFd() { ::close(fd); }
    } meta_closer{*meta_fd};
    if (meta_size == 0) return Invalid("cannot parse " + meta_path + ": empty file");
    uint64_t meta_reported = 0;  // progress counts each byte once (the VM reads it twice)
    const PickleRead read_meta = [&](uint64_t offset, char* dst, size_t len) -> Status {
      RETURN_IF_ERROR(PreadExact(*meta_fd, offset, dst, len, meta_path));
      if (offset + len > meta_reported) {
        ReportProgress(offset + len - std::max(offset, meta_reported));
        meta_reported = offset + len;
      }
      return Status::Ok();
    };
    // The entries are taken as the VM sets them (see pickle.h, streaming): a
    // .metadata of millions of chunks never becomes a tree of Python objects.
    // Only the dicts that end up as Metadata's two fields may hold them.
    const PyValue* sdm_seen = nullptr;
    const PyValue* storage_seen = nullptr;
    PickleOptions opts;
    opts.consume = [&](const PyValue& dict, const PyValue& k, const PyValue& v) -> Result<bool> {
      const std::string vc = v.ClassName();
      const PyValue** seen = nullptr;
      if (vc == "_StorageInfo" && k.ClassName() == "MetadataIndex") {
        seen = &storage_seen;
        RETURN_IF_ERROR(add_storage(k, v));
      } else if (k.IsStr() && (vc == "TensorStorageMetadata" || vc == "BytesStorageMetadata")) {
        seen = &sdm_seen;
        RETURN_IF_ERROR(add_sdm(k, v));
      } else {
        return false;
      }
      if (*seen != nullptr && *seen != &dict) {
        return Invalid("cannot parse " + meta_path + ": " + (seen == &sdm_seen ? "tensor metadata" : "storage items") +
                       " in two different dicts");
      }
      *seen = &dict;
      return true;
    };
    // torch >= 2.6 may pickle every rank's SavePlan too (Metadata.all_local_plans,
    // which megatron-core's cached plans fill): a WriteItem per chunk and rank
    // that ckptfs never reads, dropped as it is appended.
    opts.consume_item = [](const PyValue&, const PyValue& item) -> Result<bool> {
      return item.ClassName() == "WriteItem";
    };
    auto root_or = Unpickle(meta_size, read_meta, name, opts);
    if (!root_or.ok())
      return root_or.status().message().rfind("cannot parse ", 0) == 0 ? root_or.status() : fail(root_or.status());
    const PyValue& root = **root_or;
    // megatron-core 0.12-0.15 pickled its own subclass of Metadata (MCoreMetadata,
    // with an `mcore_data` attribute beside torch's fields); today's mcore keeps a
    // dummy of the name so those checkpoints still load. Read as the DCP class.
    const std::string cls = root.ClassName();
    const bool mcore = cls == "MCoreMetadata" && root.callable &&
                       root.callable->s == "megatron.core.dist_checkpointing.strategies.torch";
    if (cls != "Metadata" && !mcore) {
      return Invalid("cannot parse " + meta_path + ": top-level object is not a DCP Metadata (" +
                     (cls.empty() ? "not an object" : "class " + cls) + ")");
    }
    const PyValue* sdm = root.Attr("state_dict_metadata");
    const PyValue* storage = root.Attr("storage_data");
    const PyValue* planner = root.Attr("planner_data");
    if (sdm == nullptr || sdm->kind != PyKind::kDict)
      return Invalid("cannot parse " + meta_path + ": no state_dict_metadata");
    if (storage == nullptr || storage->kind != PyKind::kDict)
      return Invalid("cannot parse " + meta_path + ": no storage_data");
    if ((sdm_seen != nullptr && sdm_seen != sdm) || (storage_seen != nullptr && storage_seen != storage)) {
      return Invalid("cannot parse " + meta_path +
                     ": chunk metadata outside Metadata.state_dict_metadata / storage_data");
    }
    // What the VM did not take: refused here with the reason.
    for (const auto& [k, v] : storage->dict) RETURN_IF_ERROR(add_storage(*k, *v));
    for (const auto& [k, v] : sdm->dict) RETURN_IF_ERROR(add_sdm(*k, *v));

    const PyValue* version = root.Attr("version");
    // What each release writes (tests/data/dcp_torch2x): planner_data from 2.0,
    // storage_meta from 2.4, version from 2.9; torch 1.13 writes neither
    // storage_meta nor planner_data (module names are
    // canonicalised by the VM, so the class path cannot tell the versions apart).
    const bool has_planner = planner != nullptr && planner->kind == PyKind::kDict;
    if (ck.info.format_note.empty()) {
      ck.info.format_note = std::string("DCP metadata") +
                            (version && version->IsStr() ? " version " + version->s : "") +
                            (root.Attr("storage_meta") ? " (torch >= 2.4)"
                             : has_planner             ? " (torch 2.0-2.3)"
                                                       : " (torch 1.13 _shard.checkpoint layout)");
    }
    for (size_t i = paths.size(); i < ck.tensors.size(); ++i) paths.push_back(PathOf(planner, ck.tensors[i].key));
    // Nothing below reads the unpickled tree: its arena goes before the chunks
    // are resolved, so the two never add up.
    root_or = PyHandle();
  }
  ck.info.family = Family::kPytorchDcp;
  if (saves.size() > 1) ck.info.format_note += ", Accelerate FSDP: pytorch_model_fsdp_0/ + optimizer_0/";
  // Merged chunks arrive file by file; the work list goes back to tensor order.
  if (merge)
    std::stable_sort(work.begin(), work.end(), [](const Work& x, const Work& y) { return x.tensor < y.tensor; });
  for (const DcpSave& sv : saves) {
    if (!sv.rank_local()) continue;
    ck.info.format_note += ", rank-local" + (sv.prefix.empty() ? "" : " " + sv.prefix) + ": " +
                           std::to_string(sv.meta.size()) +
                           " __<rank>.metadata files (dcp.save use_collectives=False), merged";
    // A rank whose metadata is missing: what it saved is unknown, so the
    // tensors it held a part of show holes (and are refused by the tiling check).
    std::set<uint32_t> meta_ranks;
    for (const auto& [rank, name] : sv.meta) meta_ranks.insert(rank);
    const uint32_t last = std::max(*meta_ranks.rbegin(), sv.data_ranks.empty() ? 0u : *sv.data_ranks.rbegin());
    const uint64_t missing_ranks = uint64_t{last} + 1 - meta_ranks.size();
    for (uint64_t r = 0, named = 0; r <= last && named < 16; ++r) {
      if (meta_ranks.count(r)) continue;
      ++named;  // the first 16 are named, the rest counted
      const std::string m = sv.prefix + "__" + std::to_string(r) + ".metadata";
      ck.info.Flag(Check::kCoverage, Severity::kError, "", m,
                   m + " is missing" +
                       (sv.data_ranks.count(r) ? " (rank " + std::to_string(r) + "'s data files are present)"
                                               : " (and rank " + std::to_string(r) + " wrote no data file)") +
                       ": what rank " + std::to_string(r) +
                       " saved is unknown; tensors it held a part of have holes (an interrupted save leaves " + m +
                       ".tmp)");
    }
    if (missing_ranks > 16) {
      ck.info.Flag(Check::kCoverage, Severity::kError, "", sv.prefix,
                   std::to_string(missing_ranks) + " of " + std::to_string(uint64_t{last} + 1) + " ranks in " +
                       (sv.prefix.empty() ? dir : dir + "/" + sv.prefix) +
                       " have no __<rank>.metadata (the first 16 are listed)");
    }
  }
  const std::string meta_desc = n_meta > 1 ? "the metadata files" : ".metadata";

  // Each chunk's storage item.
  size_t kept = 0;
  for (size_t i = 0; i < work.size(); ++i) {
    Work& w = work[i];
    TensorRecord& t = ck.tensors[w.tensor];
    auto id = fqn_ids.find(t.key);
    auto it = id == fqn_ids.end() ? items.end() : items.find(ChunkKey(id->second, boxes.data() + w.box, w.ndim));
    if (it == items.end()) {
      if (t.error.empty()) {
        t.error = w.bytes ? "cannot find the storage item of bytes entry '" + t.key + "' in " + meta_desc
                          : "cannot find the storage item of a chunk of '" + t.key + "' in " + meta_desc;
      }
      continue;
    }
    w.loc = it->second;
    if (kept != i) work[kept] = std::move(w);
    ++kept;
  }
  work.resize(kept);
  decltype(items)().swap(items);
  decltype(fqn_ids)().swap(fqn_ids);

  // Stat and open every file; a missing one is a per-tensor error, not fatal.
  OpenFiles files;
  files.fds.assign(ck.files.size(), -1);
  files.errors.assign(ck.files.size(), "");
  for (size_t i = 0; i < ck.files.size(); ++i) {
    auto fd = OpenAndFingerprint(dir, ck.files[i]);
    if (fd.ok()) {
      files.fds[i] = *fd;
    } else {
      files.errors[i] = fd.status().message();
    }
  }
  ck.fragments.Resize(ck.tensors.size());

  // A rank file that is missing: one finding per file, listing the holes it
  // leaves (its chunks) with their coordinates.
  std::map<uint32_t, std::vector<std::pair<std::string, std::string>>> missing;
  for (const Work& w : work) {
    if (files.fds[w.loc.file] >= 0 || ck.files[w.loc.file].mtime_ns != -1) continue;
    missing[w.loc.file].emplace_back(
        ck.tensors[w.tensor].key,
        w.bytes ? "whole entry"
                : BoxString(Box{{boxes.begin() + w.box, boxes.begin() + w.box + w.ndim},
                                {boxes.begin() + w.box + w.ndim, boxes.begin() + w.box + 2 * w.ndim}}));
  }
  for (const auto& [file, holes] : missing) {
    const std::string& rel = ck.files[file].rel_path;
    nlohmann::ordered_json d;
    std::set<std::string> keys;
    d["holes"] = nlohmann::ordered_json::array();
    for (const auto& [key, region] : holes) {
      keys.insert(key);
      if (d["holes"].size() < 16) d["holes"].push_back({{"tensor", key}, {"region", region}});
    }
    d["tensors_affected"] = keys.size();
    ck.info.Flag(Check::kCoverage, Severity::kError, "", rel,
                 rel + " is missing (.metadata lists " + std::to_string(holes.size()) + " chunk(s) in it): holes in " +
                     std::to_string(keys.size()) + " tensor(s) (first '" + holes.front().first + "' " +
                     holes.front().second + ")",
                 JsonText(d));
  }

  // Resolve every item, in parallel over the work list (index build is
  // dominated by small preads of ZIP directories on a parallel filesystem), in
  // batches: a batch's fragments and checksum ranges are handed on before the
  // next starts, so the results in memory never grow with the checkpoint.
  constexpr size_t kBatch = 16384;
  std::vector<Result<Fragment>> results;
  std::vector<std::vector<ChecksumRange>> sums;
  // The work list is in tensor order: a tensor's fragments are gathered here
  // and packed into ck.fragments once its last chunk is resolved.
  std::vector<Fragment> gathered;
  size_t gathering = 0;
  auto pack_gathered = [&] {
    if (!gathered.empty()) ck.fragments.Set(gathering, gathered);
    gathered.clear();
  };
  StBlocks st_blocks;
  unsigned n_threads = std::max(1u, std::min(8u, std::thread::hardware_concurrency()));
  if (work.size() < 64) n_threads = 1;
  for (size_t begin = 0; begin < work.size(); begin += kBatch) {
    const size_t end = std::min(work.size(), begin + kBatch);
    results.assign(end - begin, Result<Fragment>(Status()));
    sums.assign(end - begin, {});
    std::atomic<size_t> next{begin};
    auto worker = [&] {
      for (size_t i = next++; i < end; i = next++) {
        const Work& w = work[i];
        Result<Fragment>& result = results[i - begin];
        const std::string& rel = ck.files[w.loc.file].rel_path;
        int fd = files.fds[w.loc.file];
        if (fd < 0) {
          result = Status(Code::kNotFound, files.errors[w.loc.file]);
          continue;
        }
        uint64_t item_end;
        if (AddOverflow(w.loc.offset, w.loc.length, &item_end) || item_end > ck.files[w.loc.file].size) {
          result = Invalid("cannot read " + rel + ": item of '" + ck.tensors[w.tensor].key + "' at offset " +
                           std::to_string(w.loc.offset) + " (" + std::to_string(w.loc.length) +
                           " bytes) passes the end of the file (" + std::to_string(ck.files[w.loc.file].size) +
                           " bytes; truncated?)");
          continue;
        }
        result = ResolveChunk(w, boxes.data() + w.box, ck.tensors[w.tensor], fd, rel, ck.files[w.loc.file].size,
                              st_blocks, &sums[i - begin]);
      }
    };
    std::vector<std::thread> threads;
    for (unsigned i = 1; i < n_threads; ++i) threads.emplace_back(worker);
    worker();
    for (auto& th : threads) th.join();
    for (size_t i = begin; i < end; ++i) {
      for (const ChecksumRange& c : sums[i - begin]) ck.checksums.Add(c);
      if (work[i].tensor != gathering) {
        pack_gathered();
        gathering = work[i].tensor;
      }
      TensorRecord& t = ck.tensors[work[i].tensor];
      Result<Fragment>& result = results[i - begin];
      if (!result.ok()) {
        if (t.error.empty()) t.error = result.status().message();
        continue;
      }
      Fragment f = std::move(result).value();
      if (t.encoding == Encoding::kBytes) t.byte_size = f.data_length;
      gathered.push_back(std::move(f));
    }
  }
  pack_gathered();
  std::vector<std::vector<ChecksumRange>>().swap(sums);
  std::vector<Result<Fragment>>().swap(results);
  std::vector<Work>().swap(work);
  std::vector<int64_t>().swap(boxes);
  for (size_t i = 0; i < ck.tensors.size(); ++i) {
    TensorRecord& t = ck.tensors[i];
    if (t.error.empty() && t.encoding == Encoding::kTensor) {
      std::string detail;
      Status s = CheckTiling(t, ck.fragments.Get(i), ck.files, &detail);
      if (!s.ok()) {
        const std::string meta_rel = n_meta > 1 ? "" : ".metadata";
        t.error = s.Annotate("tensor '" + t.key + "' in " + (n_meta > 1 ? dir : dir + "/.metadata")).message();
        ck.info.Flag(Check::kCoverage, Severity::kError, t.key, meta_rel, t.error, detail);
      }
    }
    if (!t.error.empty()) ck.fragments.Clear(i);
    t.num_fragments = static_cast<uint32_t>(ck.fragments.Count(i));
  }

  ClassifyStateDict(ck.tensors, paths);
  paths.clear();

  static const RE2 kRankRe(R"(__([0-9]+)_[0-9]+(?:\.distcp)?)");
  for (const auto& f : ck.files) {
    uint32_t rank = 0;
    if (RE2::FullMatch(f.rel_path.substr(f.rel_path.rfind('/') + 1), kRankRe, &rank) && rank < UINT32_MAX) {
      ck.info.world_size = std::max<uint32_t>(ck.info.world_size, rank + 1);
    }
  }
  ck.info.step = FindStep(dir, ck, files);
  return ck;
}

}  // namespace ckptfs::formats

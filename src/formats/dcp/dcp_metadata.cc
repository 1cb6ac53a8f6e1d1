// .metadata decoding: finds the DCP saves of a directory (a global save,
// rank-local `__<rank>.metadata` files, Accelerate's FSDP pair) and reads each
// metadata file through the streaming pickle VM into tensor records, chunk
// work items and storage items, merging rank-local files by key. Contract: a
// malformed metadata file fails the read; a tensor whose entries contradict
// each other is refused on its own (an error record and a coverage finding).
#include <re2/re2.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ckptfs/formats.h"
#include "ckptfs/geometry.h"
#include "ckptfs/progress.h"
#include "common/varint.h"
#include "formats/byte_reader.h"
#include "formats/dcp/dcp_internal.h"
#include "formats/pickle.h"
#include "formats/tiling.h"

namespace ckptfs::formats::dcp {
namespace {

// The dtype recorded in a TensorProperties.
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

// A tensor's state-dict path from its planner_data entry `p` (its key alone
// when there is none).
std::vector<std::string> PathOf(const PyValue* p, const std::string& key) {
  std::vector<std::string> path;
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

// How `t` was given, for a disagreement between ranks.
std::string Describe(const TensorRecord& t) {
  return t.encoding == Encoding::kBytes ? std::string("a bytes entry")
                                        : std::string(DTypeName(t.dtype)) + " " + ShapeStr(t.shape);
}

// The save in folder `prefix` of `dir`: its metadata files (none: no save).
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

// A metadata file open for the pickle VM's windowed reads (closed on
// destruction); progress counts each byte once (the VM reads it twice).
class MetaFile {
 public:
  MetaFile(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  ~MetaFile() { ::close(fd_); }
  MetaFile(const MetaFile&) = delete;
  MetaFile& operator=(const MetaFile&) = delete;
  // Reads [offset, offset + len) into `dst` (a short read is an error).
  Status Read(uint64_t offset, char* dst, size_t len) {
    RETURN_IF_ERROR(PreadExact(fd_, offset, dst, len, path_));
    if (offset + len > reported_) {
      ReportProgress(offset + len - std::max(offset, reported_));
      reported_ = offset + len;
    }
    return Status::Ok();
  }

 private:
  int fd_;
  std::string path_;
  uint64_t reported_ = 0;
};

// torch >= 2.6 may pickle every rank's SavePlan too (Metadata.all_local_plans,
// which megatron-core's cached plans fill): a WriteItem per chunk and rank
// that ckptfs never reads, dropped as it is appended.
Result<bool> DropWriteItem(const PyValue&, const PyValue& item) { return item.ClassName() == "WriteItem"; }

}  // namespace

std::string ChunkKey(uint32_t fqn_id, const int64_t* offsets, size_t n) {
  std::string k;
  PutVarint(k, fqn_id);
  for (size_t i = 0; i < n; ++i) PutVarint(k, ZigZag(offsets[i]));
  return k;
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
  if (!out.empty()) return out;
  // Lightning's checkpoints/ folder: real directories (a symlink, such as a
  // last.ckpt link, is not followed) holding a DCP save and meta.pt.
  static const RE2 kStepRe(R"((?:^|[-_=.])step=([0-9]{1,18})(?:[-_.]|$))");
  struct Candidate {
    int64_t step;
    int64_t mtime_ns;
    std::string name;
  };
  std::vector<Candidate> found;
  for (const std::string& name : ListDirectory(dir)) {
    // ModelCheckpoint names every save <filename>.ckpt: nothing else is stat'ed.
    if (name.size() <= 5 || name.compare(name.size() - 5, 5, ".ckpt") != 0) continue;
    struct stat st {
    }, meta{}, lmeta{};
    const std::string d = dir + "/" + name;
    if (::lstat(d.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) continue;
    if (::lstat((d + "/meta.pt").c_str(), &lmeta) != 0 || !S_ISREG(lmeta.st_mode)) continue;
    if (::lstat((d + "/.metadata").c_str(), &meta) != 0 || !S_ISREG(meta.st_mode)) continue;
    int64_t step = -1;
    RE2::PartialMatch(name, kStepRe, &step);
    found.push_back({step, static_cast<int64_t>(meta.st_mtim.tv_sec) * 1000000000 + meta.st_mtim.tv_nsec, name});
    if (found.size() > 100000) break;  // bounded: a folder of checkpoints, not of files
  }
  if (found.empty()) return out;
  std::sort(found.begin(), found.end(), [](const Candidate& a, const Candidate& b) {
    return std::tie(a.step, a.mtime_ns, a.name) > std::tie(b.step, b.mtime_ns, b.name);
  });
  DcpSave latest = FindSave(dir, found[0].name + "/");
  for (size_t i = 1; i < found.size(); ++i) latest.others.push_back(found[i].name);
  out.push_back(std::move(latest));
  return out;
}

DcpReader::DcpReader(std::string dir_in, std::vector<DcpSave> saves_in)
    : dir(std::move(dir_in)), saves(std::move(saves_in)) {
  for (const DcpSave& sv : saves) n_meta += sv.meta.size();
  merge = n_meta > 1;
}

Status DcpReader::CannotParse(const Status& s) const { return s.Annotate("cannot parse " + meta_path); }

uint32_t DcpReader::AddFile(const std::string& rel) {
  auto [it, inserted] = file_ids.emplace(rel, static_cast<uint32_t>(ck.files.size()));
  if (inserted) ck.files.push_back(SourceFile{rel, 0, 0, 0});
  return it->second;
}

uint32_t DcpReader::FqnId(const std::string& fqn) {
  return fqn_ids.emplace(fqn, static_cast<uint32_t>(fqn_ids.size())).first->second;
}

Status DcpReader::AddStorage(const PyValue& k, const PyValue& v) {
  if (k.ClassName() != "MetadataIndex" || v.ClassName() != "_StorageInfo") {
    return Invalid("cannot parse " + meta_path + ": storage_data entry is not MetadataIndex -> _StorageInfo");
  }
  const PyValue* fqn = k.Attr("fqn");
  const PyValue* off = k.Attr("offset");
  if (fqn == nullptr || !fqn->IsStr()) return Invalid("cannot parse " + meta_path + ": MetadataIndex without fqn");
  std::vector<int64_t> offsets;
  if (off != nullptr && off->kind != PyKind::kNone) {
    auto o = AsIntVector(off, "MetadataIndex.offset");
    if (!o.ok()) return CannotParse(o.status());
    offsets = *o;
  }
  const PyValue* rel = v.Attr("relative_path");
  if (rel == nullptr || !rel->IsStr())
    return Invalid("cannot parse " + meta_path + ": _StorageInfo without relative_path");
  if (rel->s.empty() || rel->s.find("..") != std::string::npos || rel->s[0] == '/') {
    return Invalid("cannot parse " + meta_path + ": unsafe relative_path '" + rel->s + "'");
  }
  ItemLoc loc;
  loc.file = AddFile(cur_prefix + rel->s);
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
  items.emplace(ChunkKey(FqnId(fqn->s), offsets.data(), offsets.size()), loc);
  return Status::Ok();
}

// A key an earlier rank's metadata gave differently: the tensor is refused.
Status DcpReader::Disagree(TensorRecord& earlier, const TensorRecord& t) {
  if (earlier.error.empty()) {
    earlier.error = "cannot index '" + t.key + "': " + meta_path + " gives it as " + Describe(t) +
                    ", an earlier rank's metadata as " + Describe(earlier);
    ck.info.Flag(Check::kCoverage, Severity::kError, t.key, meta_path.substr(dir.size() + 1), earlier.error);
  }
  return Status::Ok();
}

Status DcpReader::AddTensorMetadata(const PyValue& k, const PyValue& md) {
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
  const std::string_view cls = md.ClassName();
  if (cls == "BytesStorageMetadata") {
    t.encoding = Encoding::kBytes;
    t.dtype = DType::kU8;
    if (earlier != nullptr) return earlier->encoding == Encoding::kBytes ? Status::Ok() : Disagree(*earlier, t);
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
      return Disagree(*earlier, t);
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
          rec.error = "cannot index '" + t.key + "' (" + meta_path + "): a chunk has " + std::to_string(offs->size()) +
                      " offsets and " + std::to_string(sizes->size()) + " sizes for a tensor of " +
                      std::to_string(t.shape.size()) + " dimensions";
          ck.info.Flag(Check::kCoverage, Severity::kError, t.key, meta_path.substr(dir.size() + 1), rec.error);
        }
        continue;
      }
      // Not deduplicated across ranks: a replicated chunk is read from the
      // lowest rank that lists it (as its storage item is).
      if (merge && !seen_chunks.insert(ChunkKey(FqnId(t.key), offs->data(), offs->size())).second) continue;
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
    return Unsupported("cannot parse " + meta_path + ": unknown storage metadata class " + std::string(cls) + " for '" +
                       t.key + "'");
  }
  ck.tensors.push_back(std::move(t));
  return Status::Ok();
}

// Each metadata file in turn (one, or one per rank when rank-local). The
// file is read in windows by the pickle VM (it may be hundreds of MiB),
// never held whole.
Status DcpReader::ReadMetadata() {
  for (const DcpSave& sv : saves) {
    for (const auto& [rank, name] : sv.meta) AddFile(sv.prefix + name);
  }
  for (const DcpSave& sv : saves) {
    for (const auto& [rank, name] : sv.meta) RETURN_IF_ERROR(ReadMetadataFile(sv.prefix, name));
  }
  ck.info.family = Family::kPytorchDcp;
  if (saves.size() > 1) ck.info.format_note += ", Accelerate FSDP: pytorch_model_fsdp_0/ + optimizer_0/";
  // Merged chunks arrive file by file; the work list goes back to tensor order.
  if (merge)
    std::stable_sort(work.begin(), work.end(), [](const Work& x, const Work& y) { return x.tensor < y.tensor; });
  return Status::Ok();
}

Status DcpReader::ReadMetadataFile(const std::string& prefix, const std::string& name) {
  cur_prefix = prefix;
  meta_path = dir + "/" + prefix + name;
  uint64_t meta_size = 0;
  auto meta_fd = OpenBoundedFile(meta_path, GetReadLimits().max_metadata_bytes, &meta_size);
  if (!meta_fd.ok()) return meta_fd.status();
  MetaFile meta(*meta_fd, meta_path);
  if (meta_size == 0) return Invalid("cannot parse " + meta_path + ": empty file");
  const PickleRead read_meta = [&meta](uint64_t offset, char* dst, size_t len) { return meta.Read(offset, dst, len); };
  // The entries are taken as the VM sets them (see pickle.h, streaming): a
  // .metadata of millions of chunks never becomes a tree of Python objects.
  // Only the dicts that end up as Metadata's two fields may hold them.
  StreamedDicts seen;
  PickleOptions opts;
  // Chunks are resolved early (see `resolved`) on `early`, which is joined
  // before anything else reads this reader, on every path out of here.
  std::jthread early;
  opts.consume = [this, &seen, &early](const PyValue& dict, const PyValue& k, const PyValue& v) -> Result<bool> {
    if (early.joinable()) {
      // Both dicts were complete when the plans began: an entry now is a
      // hostile pickle reaching back into them (through the memo).
      const std::string_view vc = v.ClassName();
      if (vc == "_StorageInfo" || vc == "TensorStorageMetadata" || vc == "BytesStorageMetadata")
        return Invalid("cannot parse " + meta_path + ": a " + std::string(vc) + " after all_local_plans began");
      return false;
    }
    return TakeStreamedEntry(seen, dict, k, v);
  };
  opts.consume_item = [this, &seen, &early](const PyValue& list, const PyValue& item) -> Result<bool> {
    ASSIGN_OR_RETURN(bool drop, DropWriteItem(list, item));
    if (drop && !early.joinable() && n_meta == 1 && seen.sdm != nullptr && seen.storage != nullptr) {
      early = std::jthread([this] { Resolve(); });
    }
    return drop;
  };
  auto root_or = Unpickle(meta_size, read_meta, name, opts);
  const bool resolving = early.joinable();
  if (resolving) early.join();
  if (!root_or.ok())
    return root_or.status().message().rfind("cannot parse ", 0) == 0 ? root_or.status() : CannotParse(root_or.status());
  RETURN_IF_ERROR(TakeMetadataRoot(**root_or, seen));
  // Every entry the VM left in the tree is refused by TakeMetadataRoot; were
  // one taken, the chunks resolved early would not include it.
  if (resolving && (!items.empty() || !work.empty()))
    return Invalid("cannot parse " + meta_path + ": chunks outside the entries the VM streamed");
  // Nothing below reads the unpickled tree: its arena goes before the chunks
  // are resolved, so the two never add up.
  root_or = PyHandle();
  return Status::Ok();
}

Result<bool> DcpReader::TakeStreamedEntry(StreamedDicts& seen, const PyValue& dict, const PyValue& k,
                                          const PyValue& v) {
  const std::string_view vc = v.ClassName();
  const PyValue** slot = nullptr;
  if (vc == "_StorageInfo" && k.ClassName() == "MetadataIndex") {
    slot = &seen.storage;
    RETURN_IF_ERROR(AddStorage(k, v));
  } else if (k.IsStr() && (vc == "TensorStorageMetadata" || vc == "BytesStorageMetadata")) {
    slot = &seen.sdm;
    RETURN_IF_ERROR(AddTensorMetadata(k, v));
  } else {
    return false;
  }
  if (*slot != nullptr && *slot != &dict) {
    return Invalid("cannot parse " + meta_path + ": " + (slot == &seen.sdm ? "tensor metadata" : "storage items") +
                   " in two different dicts");
  }
  *slot = &dict;
  return true;
}

Status DcpReader::TakeMetadataRoot(const PyValue& root, const StreamedDicts& seen) {
  // megatron-core 0.12-0.15 pickled its own subclass of Metadata (MCoreMetadata,
  // with an `mcore_data` attribute beside torch's fields); today's mcore keeps a
  // dummy of the name so those checkpoints still load. Read as the DCP class.
  const std::string cls(root.ClassName());
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
  if ((seen.sdm != nullptr && seen.sdm != sdm) || (seen.storage != nullptr && seen.storage != storage)) {
    return Invalid("cannot parse " + meta_path +
                   ": chunk metadata outside Metadata.state_dict_metadata / storage_data");
  }
  // What the VM did not take: refused here with the reason.
  for (const auto& [k, v] : storage->dict) RETURN_IF_ERROR(AddStorage(*k, *v));
  for (const auto& [k, v] : sdm->dict) RETURN_IF_ERROR(AddTensorMetadata(*k, *v));

  const PyValue* version = root.Attr("version");
  // What each release writes (tests/data/dcp_torch2x): planner_data from 2.0,
  // storage_meta from 2.4, version from 2.9; torch 1.13 writes neither
  // storage_meta nor planner_data (module names are
  // canonicalised by the VM, so the class path cannot tell the versions apart).
  const bool has_planner = planner != nullptr && planner->kind == PyKind::kDict;
  if (ck.info.format_note.empty()) {
    ck.info.format_note = std::string("DCP metadata") + (version && version->IsStr() ? " version " + version->s : "") +
                          (root.Attr("storage_meta") ? " (torch >= 2.4)"
                           : has_planner             ? " (torch 2.0-2.3)"
                                                     : " (torch 1.13 _shard.checkpoint layout)");
  }
  // planner_data has an entry per tensor: found by hash (a scan per tensor
  // was quadratic, half the index build of 40k tensors).
  std::unordered_map<std::string_view, const PyValue*> by_key;
  if (has_planner) {
    by_key.reserve(planner->dict.size());
    for (const auto& [k, v] : planner->dict) {
      if (k && k->kind == PyKind::kStr) by_key.emplace(k->s, v);  // the first of a repeated key, as Get
    }
  }
  for (size_t i = paths.size(); i < ck.tensors.size(); ++i) {
    auto it = by_key.find(ck.tensors[i].key);
    paths.push_back(PathOf(it == by_key.end() ? nullptr : it->second, ck.tensors[i].key));
  }
  return Status::Ok();
}

void DcpReader::NoteRankLocalSaves() {
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
}

}  // namespace ckptfs::formats::dcp

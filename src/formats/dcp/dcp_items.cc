// Item resolution: each chunk's storage item located from storage_data, the
// data files opened and fingerprinted, and every item resolved to the byte
// range of its chunk (a torch.save archive, zstd-wrapped or not, or a tensor
// of the rank file's safetensors block), in parallel and in batches; then the
// tiling check. Contract: every failure here is a per-tensor error or a
// coverage finding, never a failed read.
#include <atomic>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ckptfs/formats.h"
#include "ckptfs/geometry.h"
#include "common/json_text.h"
#include "formats/byte_reader.h"
#include "formats/dcp/dcp_internal.h"
#include "formats/safetensors/safetensors_header.h"
#include "formats/tiling.h"
#include "formats/torch_save.h"
#include "formats/zstd.h"

namespace ckptfs::formats::dcp {
namespace {

// torch.save framing around a tensor chunk's bytes inside a DCP item (ZIP
// headers, data.pkl, version records): a tensor item that decompresses past
// its chunk's bytes plus this is refused before it can exhaust memory.
constexpr uint64_t kTorchSaveSlack = uint64_t{1} << 20;

// The raw bytes of item `loc` (bounded by --max-item-bytes).
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

// Resolves chunk `w` of `r`'s work list against its opened data file: the
// error of a missing file or of an item past the file's end is its result.
Result<Fragment> ResolveWork(const DcpReader& r, const Work& w, StBlocks& st_blocks, std::vector<ChecksumRange>* sums) {
  const std::string& rel = r.ck.files[w.loc.file].rel_path;
  int fd = r.files.fds[w.loc.file];
  if (fd < 0) return Status(Code::kNotFound, r.files.errors[w.loc.file]);
  uint64_t item_end;
  if (AddOverflow(w.loc.offset, w.loc.length, &item_end) || item_end > r.ck.files[w.loc.file].size) {
    return Invalid("cannot read " + rel + ": item of '" + r.ck.tensors[w.tensor].key + "' at offset " +
                   std::to_string(w.loc.offset) + " (" + std::to_string(w.loc.length) +
                   " bytes) passes the end of the file (" + std::to_string(r.ck.files[w.loc.file].size) +
                   " bytes; truncated?)");
  }
  return ResolveChunk(w, r.boxes.data() + w.box, r.ck.tensors[w.tensor], fd, rel, r.ck.files[w.loc.file].size,
                      st_blocks, sums);
}

// The chunks [begin, end) of the work list being resolved and their results
// (fragment or error, checksum ranges), indexed from `begin`.
struct Batch {
  size_t begin = 0, end = 0;
  std::atomic<size_t> next{0};  // the next chunk a resolver thread takes
  std::vector<Result<Fragment>> results;
  std::vector<std::vector<ChecksumRange>> sums;
};

// One resolver thread: resolves the batch's next chunk until none is left.
void ResolveWorker(const DcpReader& r, StBlocks& st_blocks, Batch& b) {
  for (size_t i = b.next++; i < b.end; i = b.next++) {
    b.results[i - b.begin] = ResolveWork(r, r.work[i], st_blocks, &b.sums[i - b.begin]);
  }
}

// The work list is in tensor order: a tensor's fragments are gathered here
// and packed into ck.fragments once its last chunk is resolved.
struct FragmentGatherer {
  std::vector<Fragment> gathered;
  size_t gathering = 0;  // the tensor whose fragments are being gathered
  // Packs the gathered fragments into `ck` and starts over.
  void Pack(Checkpoint& ck) {
    if (!gathered.empty()) ck.fragments.Set(gathering, gathered);
    gathered.clear();
  }
};

}  // namespace

void DcpReader::Resolve() {
  LocateChunks();
  OpenDataFiles();
  FlagMissingFiles();
  ResolveChunks();
  CheckTilings();
  resolved = true;
}

std::string DcpReader::MetaDesc() const { return n_meta > 1 ? "the metadata files" : ".metadata"; }

void DcpReader::LocateChunks() {
  const std::string meta_desc = MetaDesc();
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
}

void DcpReader::OpenDataFiles() {
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
}

// A rank file that is missing: one finding per file, listing the holes it
// leaves (its chunks) with their coordinates.
void DcpReader::FlagMissingFiles() {
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
}

// Resolve every item, in parallel over the work list (index build is
// dominated by small preads of ZIP directories on a parallel filesystem), in
// batches: a batch's fragments and checksum ranges are handed on before the
// next starts, so the results in memory never grow with the checkpoint.
void DcpReader::ResolveChunks() {
  ck.fragments.Resize(ck.tensors.size());
  constexpr size_t kBatch = 16384;
  Batch batch;
  FragmentGatherer gather;
  StBlocks st_blocks;
  unsigned n_threads = std::max(1u, std::min(8u, std::thread::hardware_concurrency()));
  if (work.size() < 64) n_threads = 1;
  for (size_t begin = 0; begin < work.size(); begin += kBatch) {
    const size_t end = std::min(work.size(), begin + kBatch);
    batch.begin = begin;
    batch.end = end;
    batch.next = begin;
    batch.results.assign(end - begin, Result<Fragment>(Status()));
    batch.sums.assign(end - begin, {});
    std::vector<std::thread> threads;
    for (unsigned i = 1; i < n_threads; ++i) {
      threads.emplace_back(ResolveWorker, std::cref(*this), std::ref(st_blocks), std::ref(batch));
    }
    ResolveWorker(*this, st_blocks, batch);
    for (auto& th : threads) th.join();
    for (size_t i = begin; i < end; ++i) {
      for (const ChecksumRange& c : batch.sums[i - begin]) ck.checksums.Add(c);
      if (work[i].tensor != gather.gathering) {
        gather.Pack(ck);
        gather.gathering = work[i].tensor;
      }
      TensorRecord& t = ck.tensors[work[i].tensor];
      Result<Fragment>& result = batch.results[i - begin];
      if (!result.ok()) {
        if (t.error.empty()) t.error = result.status().message();
        continue;
      }
      Fragment f = std::move(result).value();
      if (t.encoding == Encoding::kBytes) t.byte_size = f.data_length;
      gather.gathered.push_back(std::move(f));
    }
  }
  gather.Pack(ck);
  std::vector<std::vector<ChecksumRange>>().swap(batch.sums);
  std::vector<Result<Fragment>>().swap(batch.results);
  std::vector<Work>().swap(work);
  std::vector<int64_t>().swap(boxes);
}

void DcpReader::CheckTilings() {
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
}

}  // namespace ckptfs::formats::dcp

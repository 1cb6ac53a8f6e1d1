#include "ckptfs/index.h"

#include <fcntl.h>
#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/sst_file_writer.h>
#include <rocksdb/table.h>
#include <rocksdb/write_batch.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <functional>
#include <mutex>
#include <thread>

#include "ckptfs/formats.h"
#include "ckptfs/progress.h"
#include "index/codec.h"

namespace ckptfs {

namespace fs = std::filesystem;
using index::KeyU32;
using index::KeyU32U32;

struct Index::Db {
  std::unique_ptr<rocksdb::DB> db;
};

Index::~Index() = default;

namespace {

constexpr const char* kSchemaKey = "m:schema";
constexpr const char* kInfoKey = "m:info";

rocksdb::Options DbOptions() {
  rocksdb::Options o;
  // Small and read-mostly: one SST, no background compaction after the build,
  // a tiny block cache (fragments are cached by the callers that need them).
  o.max_open_files = 64;
  o.keep_log_file_num = 1;
  o.info_log_level = rocksdb::InfoLogLevel::WARN_LEVEL;
  rocksdb::BlockBasedTableOptions t;
  t.block_cache = nullptr;
  t.no_block_cache = false;
  o.table_factory.reset(rocksdb::NewBlockBasedTableFactory(t));
  return o;
}

Status FromRocks(const rocksdb::Status& s, const std::string& verb, const std::string& dir) {
  if (s.ok()) return Status::Ok();
  return IoError("cannot " + verb + " index " + dir + ": " + s.ToString());
}

std::string SchemaValue() { return "ckptfs-index-v" + std::to_string(Index::SchemaVersion()); }

// Index::Build's records on their way from the encoder thread to the SST
// writer, in key order, a batch at a time; at most kMaxBatches wait, so memory
// does not grow with the checkpoint.
class RecordQueue {
 public:
  using Batch = std::vector<std::pair<std::string, std::string>>;
  static constexpr size_t kBatch = 4096;
  static constexpr size_t kMaxBatches = 4;

  // Encoder: one record; false once the writer has given up.
  bool Put(std::string k, std::string v) {
    filling_.emplace_back(std::move(k), std::move(v));
    if (filling_.size() < kBatch) return !cancelled_.load(std::memory_order_relaxed);
    return Flush();
  }
  // Encoder: done, with its status (the rest of the batch is handed on).
  void Close(Status s) {
    if (s.ok()) Flush();
    std::lock_guard<std::mutex> lock(mu_);
    status_ = std::move(s);
    closed_ = true;
    cv_.notify_all();
  }
  // Writer: the next batch (false: none is left).
  bool Next(Batch& out) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !ready_.empty() || closed_; });
    if (ready_.empty()) return false;
    out = std::move(ready_.front());
    ready_.pop_front();
    cv_.notify_all();
    return true;
  }
  // Writer: stop the encoder (a write failed).
  void Cancel() {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_ = true;
    cv_.notify_all();
  }
  // The encoder's status, once it has closed the queue.
  Status status() {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }

 private:
  bool Flush() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return ready_.size() < kMaxBatches || cancelled_; });
    if (cancelled_) return false;
    if (!filling_.empty()) ready_.push_back(std::move(filling_));
    filling_ = Batch();
    filling_.reserve(kBatch);
    cv_.notify_all();
    return true;
  }

  Batch filling_;  // the encoder's own
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Batch> ready_;
  bool closed_ = false;
  std::atomic<bool> cancelled_{false};
  Status status_;
};

// Every record of `ck`'s index, in key order (c < f < g < m < t < x, numbers
// big-endian), into `q`.
Status EncodeRecords(const Checkpoint& ck, RecordQueue& q) {
  Status st;
  auto put = [&](std::string k, std::string v) {
    if (!q.Put(std::move(k), std::move(v))) st = Internal("index build cancelled: the SST write failed");
    return st.ok();
  };
  // Keyed by (file, offset): ChecksumSet hands them over sorted, the first
  // of any repeat only.
  RETURN_IF_ERROR(ck.checksums.ForEach([&](const ChecksumRange& c) {
    if (c.file.v >= ck.files.size()) return Invalid("cannot build index: a checksum names an unknown file");
    put(index::KeyU32U64('c', c.file.v, c.offset), index::EncodeChecksum(c));
    return st;
  }));
  for (size_t i = 0; i < ck.files.size(); ++i)
    put(KeyU32('f', static_cast<uint32_t>(i)), index::EncodeFile(ck.files[i]));
  std::vector<uint64_t> json_bytes(ck.tensors.size());  // info.json's "fragments" (keys 't' follow 'g')
  std::string frag_json;
  for (size_t i = 0; i < ck.tensors.size() && st.ok(); ++i) {
    const std::vector<Fragment> frags = ck.fragments.Get(i);
    for (size_t j = 0; j < frags.size(); ++j) {
      put(KeyU32U32('g', static_cast<uint32_t>(i), static_cast<uint32_t>(j)), index::EncodeFragment(frags[j]));
    }
    frag_json.clear();
    AppendFragmentsJson(frag_json, frags, ck.files, ck.tensors[i].replicas);
    json_bytes[i] = frag_json.size();
  }
  put(kInfoKey, index::EncodeInfo(ck.info));
  put(kSchemaKey, SchemaValue());
  for (size_t i = 0; i < ck.tensors.size() && st.ok(); ++i) {
    TensorRecord t = ck.tensors[i];
    t.fragments_json_bytes = json_bytes[i];
    put(KeyU32('t', static_cast<uint32_t>(i)), index::EncodeTensor(t));
  }
  for (size_t i = 0; i < ck.exports.size() && st.ok(); ++i)
    put(KeyU32('x', static_cast<uint32_t>(i)), index::EncodeExport(ck.exports[i]));
  return st;
}

}  // namespace

// Bump whenever a reader's output changes, too (v6: TP split rules; v7:
// mean-of-replicas tensors, DeepSpeed pipeline checkpoints; v9: Megatron
// distributed-optimizer states and MoE experts, the master-mismatch check).
// v10: checksum ranges keyed by (file, offset). v11: nested zstd items (Orbax).
// v17: Megatron's param groups for dcp/. v18: torch_dist/'s common.pt of a
// NeMo 2 run (its one optimizer unwrapped, `iteration` from global_step).
// v19: a MoE ChainedOptimizer's param groups from its members' per-DP-rank
// objects. v20: DeepSpeed MoE's expert groups with every expert. v21:
// torch_dist/'s reason when common.pt's optimizer is None. v22: one rule for a
// ChainedOptimizer's members (megatron::ChainedMembers): chained_<i> keys in
// torch_dist/'s common.pt too.
uint32_t Index::SchemaVersion() { return 22; }

Status CompareFingerprint(const std::string& path, const SourceFile& f, const struct stat* now) {
  if (f.mtime_ns == -1) return now == nullptr ? Status::Ok() : Stale(path + " appeared after indexing");
  if (now == nullptr) return Stale(path + " disappeared after indexing");
  if (static_cast<uint64_t>(now->st_size) != f.size) {
    return Stale(path + " changed size after indexing (" + std::to_string(f.size) + " -> " +
                 std::to_string(now->st_size) + " bytes)");
  }
  if (now->st_ino != f.inode) return Stale(path + " was replaced (a new inode) after indexing");
  if (StatNs(now->st_mtim) != f.mtime_ns || StatNs(now->st_ctim) != f.ctime_ns) {
    return Stale(path + " was modified after indexing");
  }
  return Status::Ok();
}

Status CheckFingerprint(const std::string& src_dir, const std::vector<SourceFile>& files) {
  for (const auto& f : files) {
    std::string path = src_dir + "/" + f.rel_path;
    struct stat st {};
    RETURN_IF_ERROR(CompareFingerprint(path, f, ::stat(path.c_str(), &st) == 0 ? &st : nullptr));
  }
  return Status::Ok();
}

Status Index::Build(const Checkpoint& ck, const std::string& dir) {
  std::error_code ec;
  fs::path target(dir);
  fs::create_directories(target.parent_path(), ec);
  if (ec) return IoError("cannot create " + target.parent_path().string() + ": " + ec.message());
  std::string tmp = dir + ".tmp." + std::to_string(::getpid());
  fs::remove_all(tmp, ec);
  // The records stream, in key order (c < f < g < m < t < x, numbers
  // big-endian), into one SST file that the new DB ingests: no memtable, no
  // write-ahead log and no compaction, and memory does not grow with the
  // number of fragments.
  for (size_t i = 0; i < ck.exports.size(); ++i) {
    for (const ExportPart& part : ck.exports[i].parts) {
      if (part.kind != PartKind::kLiteral && part.tensor >= ck.tensors.size()) {
        return Invalid("cannot build index: export " + ck.exports[i].path + " names an unknown tensor");
      }
    }
  }
  const std::string sst = tmp + ".sst";
  auto fail = [&](Status s) {
    if (s.ok()) return s;
    fs::remove_all(tmp, ec);
    fs::remove(sst, ec);
    return s;
  };
  {
    rocksdb::Options o = DbOptions();
    rocksdb::SstFileWriter writer(rocksdb::EnvOptions(), o);
    RETURN_IF_ERROR(fail(FromRocks(writer.Open(sst), "create", sst)));
    // The records are encoded on a thread of their own (merging the checksum
    // runs, unpacking fragments) while this one writes them (building and
    // compressing blocks): the two halves of the build overlap.
    RecordQueue q;
    std::jthread encoder([&] { q.Close(EncodeRecords(ck, q)); });
    Status st;
    RecordQueue::Batch batch;
    while (st.ok() && q.Next(batch)) {
      for (const auto& [k, v] : batch) {
        st = FromRocks(writer.Put(k, v), "write", sst);
        if (!st.ok()) break;
      }
    }
    if (!st.ok()) q.Cancel();
    encoder.join();
    if (st.ok()) st = q.status();
    if (st.ok()) st = FromRocks(writer.Finish(), "finish", sst);
    if (!st.ok()) return fail(st);
  }
  {
    rocksdb::Options o = DbOptions();
    o.create_if_missing = true;
    rocksdb::DB* raw = nullptr;
    Status st = FromRocks(rocksdb::DB::Open(o, tmp, &raw), "create", tmp);
    if (!st.ok()) return fail(st);
    std::unique_ptr<rocksdb::DB> db(raw);
    rocksdb::IngestExternalFileOptions io;
    io.move_files = true;
    st = FromRocks(db->IngestExternalFile({sst}, io), "ingest", tmp);
    if (st.ok()) st = FromRocks(db->Close(), "close", tmp);
    if (!st.ok()) return fail(st);
  }
  fs::remove(sst, ec);  // ingestion moved it (a link); the name may remain
  // Swap in: the old (stale) index moves aside first; rename(2) is atomic.
  std::string old = dir + ".old." + std::to_string(::getpid());
  bool had_old = fs::exists(dir, ec);
  if (had_old && ::rename(dir.c_str(), old.c_str()) != 0) {
    fs::remove_all(tmp, ec);
    return ErrnoStatus("replace", dir, errno);
  }
  if (::rename(tmp.c_str(), dir.c_str()) != 0) {
    int e = errno;
    fs::remove_all(tmp, ec);
    return ErrnoStatus("install index at", dir, e);
  }
  if (had_old) fs::remove_all(old, ec);  // best effort: a leftover .old is harmless
  return Status::Ok();
}

Result<std::unique_ptr<Index>> Index::Open(const std::string& dir, const std::string& src_dir) {
  std::unique_ptr<Index> ix(new Index());
  ix->dir_ = dir;
  ix->src_dir_ = src_dir;
  ix->db_ = std::make_unique<Db>();
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) return NotFound("no index at " + dir);
  rocksdb::DB* raw = nullptr;
  // Every table file is opened now (max_open_files -1) and kept open: a
  // rebuild that swaps the directory later (`ckptfs index --force` beside a
  // mount) removes names, not the files this index reads.
  rocksdb::Options o = DbOptions();
  o.max_open_files = -1;
  RETURN_IF_ERROR(FromRocks(rocksdb::DB::OpenForReadOnly(o, dir, &raw), "open", dir));
  ix->db_->db.reset(raw);
  rocksdb::DB* db = raw;
  std::string v;
  if (!db->Get(rocksdb::ReadOptions(), kSchemaKey, &v).ok() || v != SchemaValue()) {
    return Stale("index " + dir + " has schema '" + v + "', this ckptfs writes '" + SchemaValue() + "'");
  }
  if (!db->Get(rocksdb::ReadOptions(), kInfoKey, &v).ok())
    return Invalid("cannot open index " + dir + ": no info record");
  ASSIGN_OR_RETURN(ix->info_, index::DecodeInfo(v));
  std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions()));
  for (it->Seek("f"); it->Valid() && it->key().starts_with("f"); it->Next()) {
    ASSIGN_OR_RETURN(SourceFile f, index::DecodeFile(std::string_view(it->value().data(), it->value().size())));
    ix->files_.push_back(std::move(f));
  }
  for (it->Seek("t"); it->Valid() && it->key().starts_with("t"); it->Next()) {
    ASSIGN_OR_RETURN(TensorRecord t, index::DecodeTensor(std::string_view(it->value().data(), it->value().size())));
    ix->num_fragments_ += t.num_fragments;
    ix->tensors_.push_back(std::move(t));
  }
  for (it->Seek("x"); it->Valid() && it->key().starts_with("x"); it->Next()) {
    ASSIGN_OR_RETURN(ExportFile x, index::DecodeExport(std::string_view(it->value().data(), it->value().size())));
    for (const ExportPart& part : x.parts) {
      if (part.kind != PartKind::kLiteral && part.tensor >= ix->tensors_.size()) {
        return Invalid("cannot read index " + dir + ": export " + x.path + " names an unknown tensor");
      }
    }
    ix->exports_.push_back(std::move(x));
  }
  RETURN_IF_ERROR(FromRocks(it->status(), "scan", dir));
  RETURN_IF_ERROR(CheckFingerprint(src_dir, ix->files_));
  return ix;
}

namespace {

// The fragment record under a 'g' key, checked against the file table.
Result<Fragment> FragmentAt(const rocksdb::Iterator& it, size_t num_files, const std::string& dir) {
  ASSIGN_OR_RETURN(Fragment f, index::DecodeFragment(std::string_view(it.value().data(), it.value().size())));
  if (f.file.v >= num_files) return Invalid("cannot read index " + dir + ": fragment names an unknown file");
  return f;
}

}  // namespace

Status Index::CheckFragmentCount(TensorId id, size_t n) const {
  if (n == tensors_[id.v].num_fragments) return Status::Ok();
  return Invalid("cannot read index " + dir_ + ": tensor '" + tensors_[id.v].key + "' has " + std::to_string(n) +
                 " fragments, expected " + std::to_string(tensors_[id.v].num_fragments));
}

Result<std::vector<Fragment>> Index::Fragments(TensorId id) const {
  if (id.v >= tensors_.size()) return NotFound("no tensor " + std::to_string(id.v) + " in the index");
  std::vector<Fragment> out;
  out.reserve(tensors_[id.v].num_fragments);
  std::string prefix = KeyU32('g', id.v);
  std::unique_ptr<rocksdb::Iterator> it(db_->db->NewIterator(rocksdb::ReadOptions()));
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    ASSIGN_OR_RETURN(Fragment f, FragmentAt(*it, files_.size(), dir_));
    out.push_back(std::move(f));
  }
  RETURN_IF_ERROR(FromRocks(it->status(), "scan", dir_));
  RETURN_IF_ERROR(CheckFragmentCount(id, out.size()));
  return out;
}

Status Index::ForEachFragments(const std::function<Status(TensorId, std::vector<Fragment>&)>& fn) const {
  const std::string prefix(1, 'g');
  std::unique_ptr<rocksdb::Iterator> it(db_->db->NewIterator(rocksdb::ReadOptions()));
  std::vector<Fragment> frags;
  uint32_t current = UINT32_MAX;
  auto flush = [&]() -> Status {
    if (current == UINT32_MAX) return Status::Ok();
    RETURN_IF_ERROR(CheckFragmentCount(TensorId{current}, frags.size()));
    Status st = fn(TensorId{current}, frags);
    frags.clear();
    return st;
  };
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    // The key is 'g', the tensor id (KeyU32: big-endian), the fragment's ordinal.
    const std::string_view key(it->key().data(), it->key().size());
    if (key.size() < 5) return Invalid("cannot read index " + dir_ + ": a fragment key is cut short");
    uint32_t id = 0;
    for (size_t i = 1; i < 5; ++i) id = id << 8 | static_cast<uint8_t>(key[i]);
    if (id >= tensors_.size()) return Invalid("cannot read index " + dir_ + ": a fragment names an unknown tensor");
    if (id != current) {
      RETURN_IF_ERROR(flush());
      current = id;
    }
    ASSIGN_OR_RETURN(Fragment f, FragmentAt(*it, files_.size(), dir_));
    frags.push_back(std::move(f));
  }
  RETURN_IF_ERROR(FromRocks(it->status(), "scan", dir_));
  return flush();
}

namespace {

// A checksum record, checked against its key and the file table.
Result<ChecksumRange> ChecksumAt(const rocksdb::Iterator& it, size_t num_files, const std::string& dir) {
  auto c = index::DecodeChecksum(std::string_view(it.value().data(), it.value().size()));
  if (!c.ok()) return c.status().Annotate("cannot read index " + dir);
  if (c->file.v >= num_files || index::KeyU32U64('c', c->file.v, c->offset) != it.key().ToStringView()) {
    return Invalid("cannot read index " + dir + ": a checksum record names an unknown file or another key");
  }
  return c;
}

}  // namespace

Result<std::vector<ChecksumRange>> Index::ChecksumsIn(FileId file, uint64_t lo, uint64_t hi) const {
  std::vector<ChecksumRange> out;
  if (hi <= lo) return out;
  const std::string prefix = KeyU32('c', file.v);
  std::unique_ptr<rocksdb::Iterator> it(db_->db->NewIterator(rocksdb::ReadOptions()));
  // The last range starting at or before lo may reach into [lo, hi).
  it->SeekForPrev(index::KeyU32U64('c', file.v, lo));
  if (!it->Valid() || !it->key().starts_with(prefix)) it->Seek(prefix);
  for (; it->Valid() && it->key().starts_with(prefix); it->Next()) {
    ASSIGN_OR_RETURN(ChecksumRange c, ChecksumAt(*it, files_.size(), dir_));
    if (c.offset >= hi) break;
    if (c.offset + c.length > lo) out.push_back(std::move(c));
  }
  RETURN_IF_ERROR(FromRocks(it->status(), "scan", dir_));
  return out;
}

Status Index::ScanChecksums(size_t batch, const std::function<Status(std::vector<ChecksumRange>&)>& fn) const {
  std::vector<ChecksumRange> v;
  std::unique_ptr<rocksdb::Iterator> it(db_->db->NewIterator(rocksdb::ReadOptions()));
  for (it->Seek("c"); it->Valid() && it->key().starts_with("c"); it->Next()) {
    ASSIGN_OR_RETURN(ChecksumRange c, ChecksumAt(*it, files_.size(), dir_));
    v.push_back(std::move(c));
    if (v.size() >= std::max<size_t>(batch, 1)) {
      RETURN_IF_ERROR(fn(v));
      v.clear();
    }
  }
  RETURN_IF_ERROR(FromRocks(it->status(), "scan", dir_));
  if (!v.empty()) RETURN_IF_ERROR(fn(v));
  return Status::Ok();
}

std::string UserCacheDir() {
  std::string base;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x != '\0') {
    base = x;
  } else if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0') {
    base = std::string(h) + "/.cache";
  } else {
    base = "/tmp/ckptfs-cache-" + std::to_string(::getuid());
  }
  return base + "/ckptfs";
}

std::string DefaultIndexDir(const std::string& src_dir) {
  if (::access(src_dir.c_str(), W_OK) == 0) return src_dir + "/" + kIndexDirName + "/index";
  std::error_code ec;
  std::string canon = fs::weakly_canonical(src_dir, ec).string();
  return UserCacheDir() + "/" + Hex64(std::hash<std::string>{}(canon.empty() ? src_dir : canon));
}

namespace {

// Builds of one index are serialized by an flock(2) on "<dir>.lock" beside it,
// and opens hold it shared: every rank of a node mounting the same checkpoint
// (or a `ckptfs info` beside a mount) builds it once, the others wait and open
// what it built, and no open ever reads a directory that a rebuild is swapping
// (RocksDB reads MANIFEST, then the table files, by path). Where the lock file
// cannot be created (a read-only location) no lock is taken: nothing can build
// there either.
class IndexLock {
 public:
  IndexLock(const std::string& dir, bool exclusive) {
    std::error_code ec;
    fs::create_directories(fs::path(dir).parent_path(), ec);
    fd_ = ::open((dir + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) fd_ = ::open((dir + ".lock").c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) return;
    while (::flock(fd_, exclusive ? LOCK_EX : LOCK_SH) != 0) {
      if (errno != EINTR) {  // e.g. a file system without flock: go on unlocked
        ::close(fd_);
        fd_ = -1;
        return;
      }
    }
  }
  ~IndexLock() {
    if (fd_ >= 0) ::close(fd_);  // releases the lock
  }
  IndexLock(const IndexLock&) = delete;
  IndexLock& operator=(const IndexLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace

Result<OpenResult> OpenOrBuild(const std::string& src_dir, const std::string& index_dir, bool force_rebuild,
                               Family family) {
  OpenResult r;
  std::string dir = index_dir.empty() ? DefaultIndexDir(src_dir) : index_dir;
  // Nothing is written (an index, its lock, .ckptfs/) for a directory no
  // family recognises.
  if (std::error_code ec; !fs::exists(dir, ec) || family != Family::kUnknown) {
    RETURN_IF_ERROR(Recognise(src_dir, family));
  }
  // An index is reused when fresh and, under --family, of that family.
  auto usable = [&](Result<std::unique_ptr<Index>>& opened) {
    if (!opened.ok()) return false;
    if (family == Family::kUnknown || (*opened)->info().family == family) return true;
    opened = Invalid("--family " + std::string(FamilyName(family)) + ": the index holds " +
                     std::string(FamilyName((*opened)->info().family)));
    return false;
  };
  if (!force_rebuild) {
    IndexLock shared(dir, false);
    auto opened = Index::Open(dir, src_dir);
    if (usable(opened)) {
      r.index = std::move(opened).value();
      return r;
    }
  }
  IndexLock exclusive(dir, true);
  if (!force_rebuild) {
    // Another process may have built it while this one waited for the lock.
    auto opened = Index::Open(dir, src_dir);
    if (usable(opened)) {
      r.index = std::move(opened).value();
      return r;
    }
    if (opened.status().code() != Code::kNotFound) {
      r.why_rebuilt = opened.status().message();
      LogInfo("rebuilding index " + dir + ": " + r.why_rebuilt);
    }
  }
  auto t0 = std::chrono::steady_clock::now();
  // The parsers report the source bytes they read (metadata, headers, zip
  // directories): the total is not known before they finish.
  Progress progress("indexing " + src_dir, 0, Progress::Unit::kBytes);
  Result<Checkpoint> read = [&] {
    ProgressScope scope(&progress);
    return ReadCheckpoint(src_dir, family);
  }();
  if (!read.ok()) return read.status();
  const Checkpoint& ck = *read;
  RETURN_IF_ERROR(Index::Build(ck, dir));
  progress.Finish();
  r.build_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.built = true;
  ASSIGN_OR_RETURN(r.index, Index::Open(dir, src_dir));
  return r;
}

}  // namespace ckptfs

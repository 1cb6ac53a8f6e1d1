// The checkpoint data model shared by formats (which emit it), index (which
// stores it), views (which map it to a tree) and io (which reads it).
//
// Identifiers. Three kinds of numbers name things and must not be mixed:
//  * FileId   — position of a source file in the checkpoint's file list; the
//               index stores one SourceFile per id and fingerprints it.
//  * TensorId — position of a logical tensor (or bytes entry) in the index;
//               stable for one index build, never reused across builds.
//  * inode    — a node of the virtual tree (views); assigned by the view
//               builder, unrelated to TensorId (one tensor backs several
//               files: .npy, .raw, info.json).
// A Fragment is addressed by (TensorId, ordinal); the index keeps all of one
// tensor's fragments under one key prefix so they come back in one scan.
#ifndef CKPTFS_MODEL_H_
#define CKPTFS_MODEL_H_

#include <time.h>

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/common.h"
#include "ckptfs/family.h"
#include "ckptfs/geometry.h"

namespace ckptfs {

struct FileId {
  uint32_t v = 0;
  bool operator==(const FileId& o) const { return v == o.v; }
};
struct TensorId {
  uint32_t v = 0;
  bool operator==(const TensorId& o) const { return v == o.v; }
};

enum class DType : uint8_t {
  kInvalid = 0,
  kBool,
  kU8,
  kI8,
  kI16,
  kI32,
  kI64,
  kU16,
  kU32,
  kU64,
  kF16,
  kBF16,
  kF32,
  kF64,
  kC64,
  kC128,
  kF8E4M3FN,
  kF8E5M2,
  kF8E4M3FNUZ,
  kF8E5M2FNUZ,
};

size_t DTypeSize(DType d);
// The widening the read engine renders (io.h CanConvert): bf16, f16 and the
// fp8 formats to float32.
bool WidensToF32(DType d);
// The narrowing it renders: float32 to bf16 or f16, round to nearest even.
bool NarrowsFromF32(DType d);
// Every element conversion the read engine renders: identity, the widening
// and the narrowing above (io.h CanConvert is this; views plan with it).
bool Renders(DType from, DType to);
std::string_view DTypeName(DType d);           // torch spelling: "float32", "bfloat16"
DType DTypeFromTorchName(std::string_view n);  // "float32" / "FloatStorage" ...
// torch's typed-storage class ("FloatStorage"); empty when there is none.
std::string_view StorageClassName(DType d);
// safetensors header dtype ("BF16", "F8_E4M3"); empty when safetensors has none.
std::string_view SafetensorsDType(DType d);
// The inverse; kInvalid for a name safetensors does not define here.
DType DTypeFromSafetensorsName(std::string_view n);
// numpy descr for .npy headers ("<f4"); empty when numpy has no such dtype.
std::string_view NumpyDescr(DType d);
// The dtype a .npy view uses: bf16 and fp8 widen to float32, others keep theirs.
DType NpyDType(DType d);
// IEEE half -> float (exact).
float HalfToFloat(uint16_t h);
// One element at `p` as a double (float and integer dtypes); false for others.
bool ElementAsDouble(const char* p, DType d, double* out);

// kHidden: reachable only through an ExportFile (e.g. a verbatim copy of a
// source file inside universal/), never listed under params/ or other/.
enum class Role : uint8_t { kParam = 0, kOptimState = 1, kOther = 2, kHidden = 3 };
enum class Encoding : uint8_t {
  kTensor = 0,  // fragments are N-d boxes of elements
  kBytes = 1,   // one fragment: an opaque byte range served verbatim
};
// kZstd: the fragment's item is one zstd frame at [item_offset, +item_length)
// of its file. kZstdNested: that frame decompresses to a container (an OCDBT
// B+tree node) holding, at [inner_offset, +inner_length), the item's own zstd
// frame (a value stored inline in the node); data_offset is inside the item.
enum class Compression : uint8_t { kNone = 0, kZstd = 1, kZstdNested = 2 };

struct SourceFile {
  std::string rel_path;  // relative to the checkpoint directory
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  uint64_t inode = 0;
  // Status change time: an in-place edit that restores the mtime (touch -d,
  // rsync -t, cp -p) still moves it, and users cannot set it.
  int64_t ctime_ns = 0;
};

inline int64_t StatNs(const struct timespec& t) { return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec; }

// Where one piece of a tensor lives.
struct Fragment {
  FileId file;
  // Box of the global tensor this fragment holds (element coordinates).
  std::vector<int64_t> offsets;
  std::vector<int64_t> lengths;
  // Layout of the fragment's elements in its storage: element (i_0..i_n-1)
  // (local coordinates) is at byte data_offset + sum(i_d * strides[d]) * size.
  std::vector<int64_t> strides;
  DType dtype = DType::kInvalid;
  // Uncompressed: absolute byte offset in the file. Compressed: offset inside
  // the decompressed item [item_offset, item_offset + item_length).
  uint64_t data_offset = 0;
  // Bytes of storage the fragment may touch (bounds-checked at index time).
  uint64_t data_length = 0;
  Compression compression = Compression::kNone;
  uint64_t item_offset = 0;
  uint64_t item_length = 0;
  // kZstdNested: the item's frame inside the decompressed container.
  uint64_t inner_offset = 0;
  uint64_t inner_length = 0;
  // Which copy of the tensor this fragment belongs to when the tensor is a
  // mean of copies (TensorRecord::replicas > 1); 0 otherwise.
  uint32_t replica = 0;
};

// How a parameter (and each optimizer state of its shape) divides among
// tensor-parallel ranks, as the family reader knows it (Megatron layer types,
// DeepSpeed universal_checkpoint_info). kUnknown: the reader has no rule; the
// topo/ planner then uses a rules file or name conventions.
enum class SplitKind : uint8_t {
  kUnknown = 0,
  kReplicate = 1,  // every TP rank holds the whole tensor
  kDim = 2,        // contiguous chunks along `dim`
  kSub2 = 3,       // two sub-parameters stacked on dim 0 ([W; V], SwiGLU): each
                   // rank holds [W_r; V_r]
};
struct TensorSplit {
  SplitKind kind = SplitKind::kUnknown;
  int32_t dim = 0;
  // The split dim is `groups` indivisible units (attention query groups of a
  // fused QKV): TP must divide it. 0: any element boundary.
  int64_t groups = 0;
  // A vocabulary tensor whose rows were clipped to the true vocabulary
  // (DeepSpeed universal): a TP that does not divide the rows pads dim 0 with
  // zero rows on the last rank, as DeepSpeed does when it loads a universal
  // checkpoint at a new TP.
  bool pad_rows = false;
};

struct TensorRecord {
  std::string key;  // the checkpoint's own flat key
  Role role = Role::kOther;
  std::string fqn;    // params/<fqn>/ (kParam, kOptimState); other/<fqn> (kOther)
  std::string state;  // "param", "exp_avg", ... ; empty for kOther
  Encoding encoding = Encoding::kTensor;
  DType dtype = DType::kInvalid;
  std::vector<int64_t> shape;
  uint64_t byte_size = 0;  // kBytes: the blob size; kTensor: numel * dtype size
  uint32_t num_fragments = 0;
  std::string error;  // non-empty: unreadable, and why (reads return EIO)
  // Its bytes are all served by other records too (a Megatron layer stack that
  // also appears per layer): `ckptfs verify` reads the others, so every source
  // byte is read once.
  bool alias = false;
  // Non-empty: the values are not stored as such but derived from another
  // copy (why, for info.json "derived"): ZeRO-3's weight rebuilt from the fp32
  // master as the engine gathers it. Fragments wider than `dtype` (float32
  // for a bf16 record) are rounded to `dtype` first, whatever the output.
  std::string derived;
  // kBytes: the bytes are not a torch.save / pickle payload (an Orbax JSON
  // file): dcp/ leaves them out, torch's loader would torch.load them.
  bool raw_bytes = false;
  TensorSplit split;
  // > 1: the tensor is the elementwise mean of this many full copies (the
  // fragments of copy r carry replica = r), computed as Python's
  // sum(copies) / n: ((0 + c_0) + c_1) + ... then / n, each step rounded to
  // `dtype` (DeepSpeed's parameter_to_average_patterns, e.g. BLOOM's
  // TP-drifted layer norms, as ds_to_universal.py merges them).
  uint32_t replicas = 1;
  // Length of AppendFragmentsJson's text for this tensor's fragments, set by
  // Index::Build: info.json answers its size without reading the fragments.
  uint64_t fragments_json_bytes = 0;
  // A vocabulary tensor stored with tensor-parallel padding rows (Megatron's
  // padded_vocab_size, the TP slices DeepSpeed merges): rows [0, vocab_rows)
  // of dim 0 are the true vocabulary (args.vocab_size, DeepSpeed's
  // original_vocab_size), the rest padding; -1: none known. The
  // topology-independent trees (params/, dcp/, universal/) serve the
  // vocabulary; params/<fqn>/<state>.vocab_padding.npy the padding rows.
  int64_t vocab_rows = -1;

  uint64_t Numel() const {
    uint64_t n = 1;
    for (int64_t s : shape) n *= static_cast<uint64_t>(s);
    return n;
  }
  bool VocabPadded() const { return vocab_rows >= 0 && !shape.empty() && vocab_rows < shape[0]; }
  // `shape` with dim 0 cut to the true vocabulary (VocabPadded), else `shape`.
  std::vector<int64_t> VocabShape() const {
    std::vector<int64_t> s = shape;
    if (VocabPadded()) s[0] = vocab_rows;
    return s;
  }
  // The rows of the true vocabulary (`padding` false) or of the padding.
  Box VocabBox(bool padding) const {
    Box b{std::vector<int64_t>(shape.size(), 0), shape};
    if (!VocabPadded()) return b;
    b.offsets[0] = padding ? vocab_rows : 0;
    b.lengths[0] = padding ? shape[0] - vocab_rows : vocab_rows;
    return b;
  }
};

// A defect of the checkpoint itself (never a limitation of ckptfs), found by
// a reader at index time or by `ckptfs verify` over the data. The checks are
// the ones users have been bitten by; see src/verify/verify.h.
enum class Check : uint8_t {
  kCoverage = 0,    // holes or overlaps in a tensor's global extent
  kCollision = 1,   // one name written by several ranks/stages, or layer numbering cut short
  kZeroed = 2,      // optimizer-state chunks entirely zero at step > 0
  kDrift = 3,       // copies that must be identical (TP/DP replicas) differ
  kGeometry = 4,    // ZeRO partition/padding metadata disagrees with the recomputed geometry
  kNumerics = 5,    // --deep: NaN or Inf values
  kUnreadable = 6,  // bytes that could not be read (corrupt, truncated, I/O error)
  kChecksum = 7,    // a source range fails the CRC-32 its file records (bit rot, a torn write)
  kMaster = 8,      // an fp32 master does not round to its weight (a mislaid optimizer shard, weights of another step)
};
enum class Severity : uint8_t {
  kError = 0,    // the bytes a loader would get are wrong or missing
  kWarning = 1,  // recorded metadata is wrong but ckptfs serves the right bytes
};
std::string_view CheckName(Check c);        // "coverage", "replica-drift", ...
std::string_view SeverityName(Severity s);  // "error", "warning"

struct Finding {
  Check check = Check::kCoverage;
  Severity severity = Severity::kError;
  std::string tensor;   // checkpoint key or FQN concerned; empty: the whole checkpoint
  std::string file;     // source file concerned, relative; may be empty
  std::string message;  // one sentence naming the file and the problem
  std::string detail;   // a JSON object (coordinates, max_abs_diff, ...); may be empty
};

// Facts about the whole checkpoint, shown in checkpoint.json and `ckptfs info`.
struct CheckpointInfo {
  Family family = Family::kUnknown;  // family.h; set by the reader that read it
  std::string format_note;           // e.g. "torch 2.x metadata", "torch 1.13 _shard.checkpoint"
  int64_t step = -1;                 // -1: unknown
  uint32_t world_size = 0;           // number of writer ranks seen
  // The parallel layout it was saved with, as a topo/ name ("tp2-pp2",
  // "tp1-pp1-dp4"); empty when the format does not say (DCP).
  std::string topology;
  // What ckptfs could not do or chose to do (unsupported parts, fallbacks):
  // notes, not defects of the checkpoint.
  std::vector<std::string> problems;
  // Defects found while indexing (replica drift, recorded-padding errors,
  // missing chunks, ...); `ckptfs verify` adds the ones that need the data.
  std::vector<Finding> findings;

  void Flag(Check c, Severity s, std::string tensor, std::string file, std::string message, std::string detail = "") {
    findings.push_back(Finding{c, s, std::move(tensor), std::move(file), std::move(message), std::move(detail)});
  }
};

// A synthesized file of the tree (e.g. universal/zero/<p>/fp32.pt), laid out
// by a family reader from metadata: literal bytes (archive headers, pickles)
// interleaved with tensors' elements and checksums computed at read time.
enum class PartKind : uint8_t {
  kLiteral = 0,
  kTensor = 1,  // tensor `tensor` in C order as `out_dtype` (kBytes: verbatim)
  kCrc32 = 2,   // 4 bytes LE: CRC-32 (zlib) of that same rendering
};
struct ExportPart {
  PartKind kind = PartKind::kLiteral;
  std::string literal;  // kLiteral
  uint32_t tensor = 0;  // kTensor, kCrc32: index into Checkpoint::tensors
  DType out_dtype = DType::kInvalid;
  uint64_t size = 0;  // bytes this part occupies in the file
  // kTensor: at most one box, the sub-box rendered (none: the whole tensor).
  // kCrc32: the CRC of these boxes' renderings concatenated (none: the whole).
  std::vector<Box> boxes;
};
struct ExportFile {
  std::string path;  // relative to the mount root, '/'-separated
  std::vector<ExportPart> parts;
};

// A byte range of a source file whose CRC-32 the file itself records: a
// stored ZIP entry of a torch.save archive (APPNOTE 4.4.7), including those
// inside DCP .distcp items. `ckptfs verify` checks every one; a mount answers
// EIO for tensors over one that failed (or, with --verify-on-read, checks
// each before serving bytes from it).
struct ChecksumRange {
  FileId file;
  uint64_t offset = 0;  // absolute, in the file
  uint64_t length = 0;
  uint32_t crc32 = 0;
  std::string name;  // the ZIP entry name, for messages
};

// The checksum ranges of a checkpoint, in bounded memory whatever their number
// (a DCP checkpoint of 1.5M chunks records 11M: 7 ZIP entries per item).
// Added in any order; past `memory_budget` bytes the ones in memory are sorted
// and written as a run to an unlinked temporary file in $TMPDIR (else /tmp);
// ForEach merges the runs. A failed spill keeps the ranges in memory and the
// error is returned by ForEach (the index build then fails naming it).
class ChecksumSet {
 public:
  // Default budget 32 MiB (about 800k ranges of DCP's entry names in memory).
  explicit ChecksumSet(size_t memory_budget = size_t{32} << 20);
  ~ChecksumSet();
  ChecksumSet(ChecksumSet&& o) noexcept;
  ChecksumSet& operator=(ChecksumSet&& o) noexcept;
  ChecksumSet(const ChecksumSet&) = delete;
  ChecksumSet& operator=(const ChecksumSet&) = delete;

  void Add(const ChecksumRange& r);
  // Ranges added, repeats included.
  uint64_t size() const { return added_; }
  // Runs written to the temporary file so far.
  size_t spilled_runs() const { return runs_.size(); }
  // Every range in (file, offset) order; of ranges with the same (file,
  // offset) only the first added. Stops at the first error `fn` returns.
  Status ForEach(const std::function<Status(const ChecksumRange&)>& fn) const;

 private:
  struct Rec {  // 32 bytes; the name lives in names_
    uint64_t offset, length;
    uint32_t file, crc32, name_at, name_len;
  };
  void Spill();
  size_t budget_;
  std::vector<Rec> recs_;
  std::string names_;
  uint64_t added_ = 0;
  int fd_ = -1;
  std::vector<std::pair<uint64_t, uint64_t>> runs_;  // [offset, bytes) in fd_
  uint64_t file_end_ = 0;
  std::string spill_error_;
};

// Empty when `t`'s shape and the fragment boxes are servable: no negative
// dimension, at most 2^60 bytes (overflow-checked), every box inside the
// shape; else why not. ReadCheckpoint applies it to every reader's records.
std::string CheckTensorGeometry(const TensorRecord& t, const std::vector<Fragment>& frags);

// The JSON objects that info.json lists for `frags` (comma-separated, no
// brackets: {"file":...,"offsets":[..],"lengths":[..],"strides":[..],
// "byte_offset":N[,"zstd_item":[off,len]][,"copy":r]}), appended to `out`;
// "copy" when the tensor is a mean of `replicas` > 1 copies.
void AppendFragmentsJson(std::string& out, const std::vector<Fragment>& frags, const std::vector<SourceFile>& files,
                         uint32_t replicas);

// Every tensor's fragments from the reader until the index is written, each
// tensor's list packed as varints (about 20 bytes per 1-D fragment instead of
// ~220 in three vectors): a DCP checkpoint of 1.5M chunks holds all of them.
// Get decodes a copy; a changed list goes back with Set.
class FragmentTable {
 public:
  size_t size() const { return packed_.size(); }
  void Resize(size_t n) { packed_.resize(n); }
  void Append(const std::vector<Fragment>& frags);
  void Set(size_t tensor, const std::vector<Fragment>& frags);
  void Clear(size_t tensor) { std::string().swap(packed_[tensor]); }
  std::vector<Fragment> Get(size_t tensor) const;
  size_t Count(size_t tensor) const;
  bool Empty(size_t tensor) const { return packed_[tensor].empty(); }

 private:
  std::vector<std::string> packed_;  // empty: no fragments
};

// What a family reader produces from metadata alone.
struct Checkpoint {
  CheckpointInfo info;
  std::vector<SourceFile> files;
  std::vector<TensorRecord> tensors;
  FragmentTable fragments;  // parallel to tensors
  std::vector<ExportFile> exports;
  ChecksumSet checksums;

  // Appends a record with its fragments and returns its index. A record in
  // error keeps no fragments; num_fragments and a kTensor's byte_size are
  // derived here (a kBytes record's byte_size is the caller's).
  uint32_t AddTensor(TensorRecord t, std::vector<Fragment> frags);
  // A kBytes record serving all of `file` verbatim (`t` gives key, role, fqn).
  uint32_t AddFileBytes(FileId file, TensorRecord t);
};

}  // namespace ckptfs

#endif  // CKPTFS_MODEL_H_

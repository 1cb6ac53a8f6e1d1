// io layer: the read engine.
//
// Design note. A read of a virtual file turns into a *plan*: the requested
// output element range is split into at most 2*rank boxes, each box is
// intersected with every fragment's box, and each intersection becomes one
// source read (the byte span of the fragment's storage it touches) plus one
// strided gather with dtype conversion. Where an intersection is contiguous in
// both source and output and needs no conversion, the source read lands
// directly in the caller's buffer. All reads of a plan go to the engine as one
// batch: io_uring (one ring per worker thread, created on first use) or pread
// (the fallback and the test oracle; both must return identical bytes).
// Plans run in output chunks of 16 MiB through a two-slot pipeline of the
// transforms backend (transforms.h): the I/O of the next chunk overlaps the
// transform of the current one, and only chunks with op work reach a backend.
// Elements not covered by any fragment are a hole: an error, never zeros.
// Every read checks the source files are unchanged since indexing (fstat), so a
// running mount answers ESTALE instead of serving bytes of another checkpoint.
//
// Mapped replies. A read whose output is a plain copy of source bytes (same
// dtype, uncompressed, no average; TP merges and ZeRO partitions included) is
// planned as source spans (PlanCopy) and handed to the kernel as pointers into
// read-only mappings of the source files (MapSpans): the FUSE reply's writev
// is then the only copy of each byte, as in a daemon replying from memory. A
// source truncated after its check makes the kernel's copy fail (EFAULT, the
// request EIO), never a SIGBUS. A conversion of such spans (bf16 widened to
// f32) is planned the same way (PlanConvert) and converted from the mappings
// by the daemon (ConvertMapped); an archive item's CRC-32 is computed over the
// mappings the same way (CrcMapped). Those are the only places it reads mapped
// bytes, only under the SIGBUS guard (RunGuarded).
#ifndef CKPTFS_IO_H_
#define CKPTFS_IO_H_

#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "ckptfs/common.h"
#include "ckptfs/geometry.h"
#include "ckptfs/index.h"
#include "ckptfs/model.h"
#include "ckptfs/transforms.h"

namespace ckptfs {
namespace formats {
class ZstdCursor;
}  // namespace formats

// `length` bytes of source file `file` at `offset`.
struct SourceSpan {
  uint32_t file = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// Where mapped bytes lie, as the iovecs of a writev, and the mapping windows
// they need kept (MapSpans).
struct MappedBytes {
  std::vector<iovec> pieces;
  std::vector<std::shared_ptr<const void>> pins;
  void Clear() {
    pieces.clear();
    pins.clear();
  }
};

// A read planned as a conversion of source spans (PlanConvert): the spans'
// elements, of dtype `src`, rendered as `out`, are the request's bytes once
// the first `skip` bytes are dropped, `len` bytes in all.
struct ConvertPlan {
  std::vector<SourceSpan> spans;
  DType src = DType::kF32, out = DType::kF32;
  uint64_t skip = 0, len = 0;
};

// Reading mapped source bytes in this process (TensorReader::ConvertMapped).
// A source file cut short under a mapping raises SIGBUS in the reading
// thread. Once InstallSigbusGuard has run (the mount calls it), RunGuarded
// returns false when fn(arg) faulted so; any other SIGBUS keeps the
// disposition it had. fn must neither lock nor allocate where it may fault.
// kUnsupported in a ThreadSanitizer build.
Status InstallSigbusGuard();
bool SigbusGuardInstalled();
bool RunGuarded(void (*fn)(void*), void* arg);

struct IoRequest {
  int fd = -1;
  uint64_t offset = 0;
  uint64_t length = 0;
  char* dst = nullptr;
};

class ReadEngine {
 public:
  virtual ~ReadEngine() = default;
  // Reads every request fully; a short read (end of file) is an error.
  virtual Status ReadBatch(std::span<IoRequest> reqs) = 0;
  virtual const char* name() const = 0;
};

std::unique_ptr<ReadEngine> MakePreadEngine();
// nullptr when io_uring is unavailable (old kernel, seccomp).
std::unique_ptr<ReadEngine> MakeUringEngine(unsigned queue_depth = 64);

enum class EngineKind : uint8_t { kAuto, kUring, kPread };
// "auto", "uring" (or "io_uring"), "pread": the --engine / engine= spelling.
Result<EngineKind> ParseEngineKind(std::string_view s);

// Element conversion for one contiguous or strided run (src_stride in
// elements). Supported: identity, bf16/f16/fp8 -> f32 widening and f32 ->
// bf16/f16 narrowing (round to nearest even).
Status ConvertRun(const char* src, DType src_dtype, int64_t src_stride, char* dst, DType dst_dtype, uint64_t n);
bool CanConvert(DType from, DType to);

// A read whose output is device memory (TensorReader::ReadToDevice):
// `backend` runs the kernels (its BeginDevice), `after` is the caller's
// stream (a cudaStream_t; null: none) the writes must follow.
struct DeviceTarget {
  Transforms* backend = nullptr;
  void* after = nullptr;
  // false: the backend's kernels differed from the CPU's (CheckAgainstCpu),
  // so every read takes the host path and only uploads run on the device.
  bool kernels_trusted = true;
};

class TensorReader {
 public:
  // `policy` picks the transforms backend per plan; null: always the CPU.
  static Result<std::unique_ptr<TensorReader>> Open(const Index& index, EngineKind kind,
                                                    std::unique_ptr<TransformPolicy> policy = nullptr);
  ~TensorReader();

  // Bytes [offset, offset+len) of tensor `id` rendered in C order as `out`.
  Status Read(TensorId id, DType out, uint64_t offset, uint64_t len, char* dst) {
    return ReadBox(id, out, nullptr, offset, len, dst);
  }
  // The same over the sub-box `box` of the tensor (null: the whole tensor),
  // rendered in C order of the box's own shape: a resharded view's slice.
  Status ReadBox(TensorId id, DType out, const Box* box, uint64_t offset, uint64_t len, char* dst);
  // The whole rendering ReadBox(id, out, box, 0, len, ...) into device
  // memory `dst` (device-resident output): every chunk's source spans are
  // read into the target's pinned staging (the same plans, no direct reads),
  // go up once, and the merge / strip / widen kernels write into `dst`; a
  // mean of replicas is averaged on the device from its staged copies. No
  // output byte passes through host memory. A failure of the device (not of
  // the checkpoint) is logged and the read done again on the host, in
  // bounded pieces uploaded to `dst` (counted in gpu_fallbacks).
  Status ReadToDevice(TensorId id, DType out, const Box* box, const DeviceTarget& target, char* dst, uint64_t len);
  // Bytes [offset, offset+len) of the transpose of boxes `rows` under `how`
  // (geometry.h Transpose: each box a matrix whose columns are its last
  // `how.col_axes` axes, the boxes' rows concatenated), in C order of that
  // transpose: [columns, total rows]. Hugging Face Conv1D weights (GPT-2: rows
  // of a 2-D tensor) and Flax kernels as Linear weights (MaxText's [emb,
  // heads, head_dim] query) are stored so. Every box must have the same
  // columns, and its axes after the first column axis whole. The engine reads
  // each box's column slice (ReadBox: merges, conversions, checks as usual)
  // into a slab of about 4 MiB of output rows, transposed here; the last few
  // slabs are kept (kTransposedSlabs), so the requests of a sequential read
  // (FUSE's 128 KiB..1 MiB) read each source byte once. A kept slab is served
  // after its source files are checked.
  Status ReadTransposedRows(TensorId id, DType out, const std::vector<Box>& rows, const Transpose& how, uint64_t offset,
                            uint64_t len, char* dst);
  // The source spans whose bytes, concatenated, are bytes [offset, offset+len)
  // of ReadBox(id, out, box, ...) when that rendering is a plain copy of
  // source bytes (the tensor's dtype, uncompressed, not a mean of copies) in
  // at most `max_spans` spans; adjacent spans are merged. Returns false when it
  // is not (the caller reads through ReadBox, which also reports any error:
  // a damaged record or a hole makes this false, not an error).
  bool PlanCopy(TensorId id, DType out, const Box* box, uint64_t offset, uint64_t len, size_t max_spans,
                std::vector<SourceSpan>* spans);
  // Appends the spans' bytes as pieces of read-only mappings of the source
  // files, after checking each file is still the indexed one (CheckFd;
  // PlanCopy declined ranges known bad). For the kernel (a writev), or read
  // here under RunGuarded only: a file that shrank since the check faults.
  Status MapSpans(std::span<const SourceSpan> spans, MappedBytes* out);
  // Asks the kernel to read the spans' bytes into the page cache (posix_fadvise
  // WILLNEED: the I/O is started, nothing waits for it or copies it), for
  // cross-file read-ahead; adjacent spans are asked as one. Returns the bytes
  // asked for (not counted in source_bytes_read: the read that uses them is).
  uint64_t AskAhead(std::span<const SourceSpan> spans);
  // As PlanCopy, for a rendering that converts every element of one source
  // dtype (bf16 -> f32 and the like): the spans cover whole elements.
  bool PlanConvert(TensorId id, DType out, const Box* box, uint64_t offset, uint64_t len, size_t max_spans,
                   ConvertPlan* plan);
  // Writes plan.len bytes to dst, converted straight from the sources'
  // mappings (MapSpans' checks first): no read into a buffer, and the
  // kernel's mmap read-around on a cold source. Needs InstallSigbusGuard(); a
  // source cut short between the check and the conversion is kStale.
  Status ConvertMapped(const ConvertPlan& plan, char* dst);
  // Continues `*crc` (zlib's CRC-32) over the spans' bytes, read from the
  // sources' mappings as ConvertMapped reads them: no copy into a buffer.
  Status CrcMapped(std::span<const SourceSpan> spans, uint32_t* crc);
  // xxh3-64 of the tensor's raw bytes (source dtype, C order), or of the
  // sub-box `box`'s; cached.
  Result<uint64_t> Xxh3Raw(TensorId id, const Box* box = nullptr);
  // CRC-32 (zlib polynomial) of the tensor rendered as `out` (kBytes: its
  // bytes); cached. Zip archives the views synthesize carry it.
  // With `boxes`: the CRC of those sub-boxes' renderings concatenated.
  Result<uint32_t> Crc32(TensorId id, DType out, const std::vector<Box>& boxes = {});
  // The tensor's source files still match the index (stat by path: catches
  // replaced files too). Called on open.
  Status CheckFresh(TensorId id);
  // Source CRC-32s (Index::ChecksumsIn / ScanChecksums). CheckChecksum(c)
  // reads range c whole and records the verdict; from then on, and for every range checked with
  // --verify-on-read (set_verify_on_read: each range is checked before the
  // first byte over it is served), a read of a tensor over a failed range is
  // an error naming the file, the entry and both CRCs.
  // `remember_good`: a pass that checks each range once (verify) keeps only
  // the failures, so its memory does not grow with the millions of ranges.
  Status CheckChecksum(const ChecksumRange& c, bool remember_good = true);
  // Range c was read and its CRC-32 did not match (not: it could not be read).
  bool ChecksumFailed(const ChecksumRange& c);
  void set_verify_on_read(bool on) { verify_on_read_ = on; }
  // Compressed items whose decompressed size may pass this are streamed, never
  // held whole (default 64 MiB; tests lower it).
  void set_stream_items_above(uint64_t bytes) { stream_items_above_ = bytes; }
  const char* engine_name() const;
  TransformPolicy* policy() const { return policy_.get(); }
  // Plans run per backend, and GPU failures that were read again on the CPU.
  struct TransformCounts {
    uint64_t cpu_plans = 0, gpu_plans = 0, gpu_fallbacks = 0;
  };
  TransformCounts transform_counts() const { return {cpu_plans_.load(), gpu_plans_.load(), gpu_fallbacks_.load()}; }
  // Bytes read from the checkpoint's files since Open (every engine batch that
  // succeeded, CRC checks and compressed items included), and the batches.
  uint64_t source_bytes_read() const { return source_bytes_.load(std::memory_order_relaxed); }
  uint64_t source_reads() const { return source_reads_.load(std::memory_order_relaxed); }

 private:
  TensorReader(const Index& index, EngineKind kind, std::unique_ptr<TransformPolicy> policy);
  // One pipeline chunk of a read: its I/O and its ops.
  struct Chunk {
    struct ItemCopy {
      std::shared_ptr<const std::string> item;  // a decompressed zstd item
      uint64_t offset = 0, length = 0, staging_off = 0;
    };
    std::vector<IoRequest> reqs;                      // dst null until staging exists, or direct
    std::vector<std::pair<size_t, uint64_t>> staged;  // (request index, staging offset)
    std::vector<ItemCopy> items;
    std::vector<GatherOp> ops;  // src_off into staging, dst_off into the output
    uint64_t staging = 0;
    std::set<uint32_t> files;
  };
  Status PlanChunk(const TensorRecord& t, const std::vector<Fragment>& frags, const Box& view, DType out, uint64_t e0,
                   uint64_t c0, uint64_t c1, bool direct, char* base, Chunk* plan);
  // `device`: `base` is device memory of tf (its BeginDevice pipeline).
  Status RunChunks(const TensorRecord& t, const std::vector<Fragment>& frags, const Box& view, DType out, uint64_t e0,
                   uint64_t e1, uint64_t chunk, Transforms& tf, char* base, const Chunk* first, bool* gpu_failed,
                   const DeviceTarget* device = nullptr);
  // ReadMean's work with the average on the device, into device memory.
  Status MeanToDevice(const TensorRecord& t, const std::vector<Fragment>& frags, const Box& view, DType out,
                      uint64_t numel, const DeviceTarget& target, char* dst, bool* gpu_failed);
  // Elements [e0, e1) of the view of a mean-of-copies tensor (replicas > 1):
  // each copy read as the source dtype, Transforms::Mean, then rendered as `out`.
  Status ReadMean(const TensorRecord& t, const std::vector<Fragment>& frags, const Box& view, DType out, uint64_t e0,
                  uint64_t e1, char* base);
  Result<std::shared_ptr<const std::vector<Fragment>>> FragmentsOf(TensorId id);
  // FragmentsOf, then the checksum ranges they lie in (CheckRanges) when
  // --verify-on-read is set or a range has failed: what every read starts from.
  Result<std::shared_ptr<const std::vector<Fragment>>> ReadableFragments(TensorId id);
  // ReadableFragments for PlanCopy / PlanConvert: null when a range they lie in
  // failed its check (or is unchecked under verify_on_read_).
  std::shared_ptr<const std::vector<Fragment>> SpanFragments(TensorId id);
  bool CollectRuns(TensorId id, DType src, uint64_t osz, const Box* box, uint64_t offset, uint64_t len,
                   size_t max_spans, std::vector<std::pair<uint64_t, SourceSpan>>* runs, uint64_t* e0);
  // f's item decompressed whole (for kZstdNested, its container too), cached.
  Result<std::shared_ptr<const std::string>> Item(const Fragment& f);
  std::shared_ptr<const std::string> CachedItem(const std::string& key);
  void KeepItem(const std::string& key, std::shared_ptr<const std::string> v);
  // Decompressed bytes [off, off + len) of f's item, as (bytes, where `off`
  // lies in them): the whole cached item when it is small (no copy), else
  // just the span, streamed through a cursor (ZstdCursor).
  Result<std::pair<std::shared_ptr<const std::string>, uint64_t>> ItemSpan(const Fragment& f, uint64_t off,
                                                                           uint64_t len);
  Status CheckFd(FileId file) const;
  // Output rows [r0, r1) of a transposed read (ReadTransposedRows); `total`:
  // the transpose's row length in elements (the rows of `rows` together).
  struct TransposedSlab {
    TensorId id;
    DType out;
    std::vector<Box> rows;
    Transpose how;
    uint64_t r0 = 0, r1 = 0;
    std::vector<char> bytes;
  };
  Result<std::shared_ptr<const TransposedSlab>> Slab(TensorId id, DType out, const std::vector<Box>& rows,
                                                     const Transpose& how, uint64_t r0, uint64_t r1, uint64_t total);
  // The checksummed ranges `frags` overlap: failed ones are an error;
  // unchecked ones are checked when verify_on_read_.
  Status CheckRanges(const std::vector<Fragment>& frags);
  // Renders the whole tensor as `out` in chunks, handing each to `fn`.
  Status Stream(TensorId id, DType out, const Box* box, const std::function<void(const char*, size_t)>& fn);
  ReadEngine& Engine();
  // A read-only mapping of source bytes [start, start + length) (MapSpans).
  struct MapWindow {
    const char* base = nullptr;
    uint64_t start = 0, length = 0;
    ~MapWindow();
  };
  Result<std::shared_ptr<const MapWindow>> Window(uint32_t file, uint64_t index);
  // Engine().ReadBatch, counted in source_bytes_read().
  Status ReadSource(std::span<IoRequest> reqs);

  const Index& index_;
  EngineKind kind_;
  std::unique_ptr<TransformPolicy> policy_;
  std::atomic<uint64_t> cpu_plans_{0}, gpu_plans_{0}, gpu_fallbacks_{0};
  std::atomic<uint64_t> source_bytes_{0}, source_reads_{0};
  std::vector<int> fds_;
  std::vector<std::string> open_errors_;
  // Lock order: each mutex below is a leaf; none is held while calling out.
  std::mutex frag_mu_;
  std::unordered_map<uint32_t, std::shared_ptr<const std::vector<Fragment>>> frag_cache_;
  std::mutex item_mu_;
  std::vector<std::pair<std::string, std::shared_ptr<const std::string>>> item_cache_;  // MRU last
  uint64_t item_cache_bytes_ = 0;
  std::mutex hash_mu_;
  std::unordered_map<std::string, uint64_t> hash_cache_;  // by tensor and box
  std::unordered_map<std::string, uint32_t> crc_cache_;   // (id, out dtype, box), under hash_mu_
  bool verify_on_read_ = false;
  // Per file: when CheckFd last found the path naming the indexed inode.
  std::unique_ptr<std::atomic<int64_t>[]> path_checked_ns_;
  uint64_t stream_items_above_ = uint64_t{64} << 20;
  // Streaming cursors of large items, most recent last (at most 8); a cursor
  // is taken out while in use, so no lock is held while decompressing.
  // `cursor_starts_`: how many cursors each item has needed (under cursor_mu_).
  std::mutex cursor_mu_;
  std::vector<std::pair<std::string, std::unique_ptr<formats::ZstdCursor>>> cursors_;
  std::unordered_map<std::string, uint32_t> cursor_starts_;
  // A large item read out of order (a second cursor from its start: one layer
  // of a stacked array after another) is decoded once into an unlinked file
  // in $TMPDIR and read back with pread: kSpillBytes of such files at most,
  // least recently used dropped first, and never more than half the free
  // space there. Under spill_mu_ (a leaf); a file is closed when the last
  // reader drops it.
  struct SpilledItem {
    std::string key;
    int fd = -1;
    uint64_t size = 0;  // decoded bytes [0, size) of the item
    ~SpilledItem();
  };
  static constexpr uint64_t kSpillBytes = 32ull << 30;
  std::mutex spill_mu_;
  std::vector<std::shared_ptr<SpilledItem>> spills_;  // most recent last
  uint64_t spill_bytes_ = 0;
  std::shared_ptr<SpilledItem> FindSpill(const std::string& key, uint64_t end);
  // A streaming cursor over f's item, to decode at most `size` bytes (and
  // 1 MiB of slack: a frame past it is refused).
  std::unique_ptr<formats::ZstdCursor> NewCursor(const Fragment& f, uint64_t size);
  // Decodes f's item [0, size) into a new spill file; nullptr when it cannot
  // (no room, no temporary file: the caller streams instead).
  Result<std::shared_ptr<SpilledItem>> SpillItem(const Fragment& f, const std::string& key, uint64_t size);
  // The transposed slabs read last, most recent first (at most kTransposedSlabs).
  static constexpr size_t kTransposedSlabs = 8;
  std::mutex slab_mu_;
  std::vector<std::shared_ptr<TransposedSlab>> slabs_;  // under slab_mu_
  std::vector<char> spare_slab_bytes_;                  // under slab_mu_: an evicted slab's buffer
  // Mapping windows of 64 MiB starting every 32 MiB, so a span of up to
  // 32 MiB lies in one; the most recently used kMapWindows are kept, keyed by
  // (file, window index), most recent last (8 readers of a 4-way merge use
  // 32). The pages a reply touched count in the daemon's RssFile until their
  // window is unmapped: page cache, not memory of the daemon's own.
  static constexpr uint64_t kMapStep = 32ull << 20, kMapWindow = 64ull << 20;
  static constexpr size_t kMapWindows = 32;
  std::mutex map_mu_;
  std::vector<std::pair<uint64_t, std::shared_ptr<const MapWindow>>> windows_;  // under map_mu_
  // Checked source ranges by (file, offset); unchecked ones are in neither.
  std::atomic<bool> any_bad_range_{false};
  std::mutex range_mu_;
  std::set<std::pair<uint32_t, uint64_t>> good_ranges_;  // under range_mu_
  struct FailedRange {
    uint64_t length = 0;
    std::string why;
  };
  std::map<std::pair<uint32_t, uint64_t>, FailedRange> failed_ranges_;  // under range_mu_
};

}  // namespace ckptfs

#endif  // CKPTFS_IO_H_

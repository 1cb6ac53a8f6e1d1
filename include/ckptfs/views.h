// Views layer: maps the index to the read-only virtual tree.
//
// Design note. The tree is built once per mount from the tensor records (no
// fragment scans, no tensor bytes), so a remount with an index costs one pass
// over the records. Every file has a *layout*: a list of segments laid end to
// end — literal bytes (headers, JSON), a tensor's elements in C order in an
// output dtype (same as the source for .raw, widened for .npy when numpy has
// no such dtype), or the 16 hex digits of the xxh3-64 of a tensor's raw bytes
// (info.json). Sizes are exact from the first stat. A few layouts need
// fragment details (info.json lists the source fragments); those are made on
// first use and then fixed.
//
// Tree:  README.txt, checkpoint.json, params/<fqn>/{param,<state>}.{npy,raw},
//        params/<fqn>/info.json, other/<key>[.npy|.raw], .ckptfs/{report.json,stats},
//        the family reader's synthesized files (ExportFile: universal/,
//        latest_universal), hf/ and topo/ (topo.h).
//
// topo/<name>/ directories are made on the first lookup of a valid name, so
// the tree grows while mounted: nodes are never removed or moved, and
// tree_mu_ guards the node list and directory children (readers share it).
#ifndef CKPTFS_VIEWS_H_
#define CKPTFS_VIEWS_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "ckptfs/common.h"
#include "ckptfs/index.h"
#include "ckptfs/model.h"
#include "ckptfs/topo.h"

namespace ckptfs {

struct DcpProfile;  // formats.h: a family's own DCP layout

// kArchive: a torch.save archive of one tensor's box (`tensor`, `out_dtype`,
// `boxes`: none or the box), laid out when it is read (View::ArchiveLayout):
// a file of a million such items (dcp/) keeps one segment per item, not its
// ZIP headers.
enum class SegmentKind : uint8_t { kLiteral, kTensor, kHash, kCrc32, kArchive, kSpooled };

// Bytes the views made too large to keep in memory (dcp/'s .metadata of a
// checkpoint of millions of chunks), written once to an unlinked file in
// $TMPDIR (common/temp_file.h), or kept in a saved plan (views/plan_cache.h),
// and read back from there; closed with the last layout that holds it.
struct SpooledBytes {
  int fd = -1;
  uint64_t base = 0;  // where the bytes start in the file (a saved plan holds several things)
  uint64_t size = 0;
  std::string name;  // the file, for errors
  SpooledBytes() = default;
  SpooledBytes(const SpooledBytes&) = delete;
  SpooledBytes& operator=(const SpooledBytes&) = delete;
  ~SpooledBytes();
  // All of [offset, offset + n) (pread, EINTR retried; a short file is EIO).
  Status Read(uint64_t offset, uint64_t n, char* dst) const;
};

// How a kTensor segment's elements are rendered beyond a copy: its boxes as
// matrices under `how` (geometry.h Transpose) when the segment is
// `transposed`, every element multiplied by `scale`, then `add` added (in
// double, rounded once to out_dtype). Rare (hf/'s Conv1D and Flax kernels,
// MaxText's and Gemma's scaled tensors), so kept out of line.
struct SegmentRender {
  Transpose how;
  double scale = 1.0, add = 0.0;
};

// One piece of a file's bytes. A checkpoint of a million chunks keeps a
// million of these in dcp/ alone, so the common case (a tensor box) is 64
// bytes and what only some kinds need sits behind one shared pointer.
struct Segment {
  SegmentKind kind = SegmentKind::kLiteral;
  DType out_dtype = DType::kInvalid;  // kTensor, kCrc32: element type written
  // kTensor: `boxes` as matrices under how(), their rows concatenated,
  // rendered in C order of the transpose (TensorReader::ReadTransposedRows).
  bool transposed = false;
  // kArchive: the archived tensor's shape has this many axes of length 1
  // before the box's (a layer of a stack, torch_dist/'s items).
  uint8_t lead_ones = 0;
  TensorId tensor;  // kTensor, kHash, kCrc32, kArchive
  uint64_t size = 0;
  // kTensor: at most one sub-box rendered (or, `transposed`, the row boxes);
  // kCrc32: the boxes whose concatenated renderings the CRC covers (none:
  // the whole tensor).
  std::vector<Box> boxes;

  // kLiteral: its bytes.
  std::string_view literal() const {
    const auto* p = std::get_if<std::shared_ptr<const std::string>>(&data_);
    return p != nullptr ? std::string_view(**p) : std::string_view();
  }
  void set_literal(std::string s) { data_ = std::make_shared<const std::string>(std::move(s)); }
  // kSpooled: the whole of its bytes (null for other kinds).
  const SpooledBytes* spooled() const {
    const auto* p = std::get_if<std::shared_ptr<const SpooledBytes>>(&data_);
    return p != nullptr ? p->get() : nullptr;
  }
  void set_spooled(std::shared_ptr<const SpooledBytes> s) { data_ = std::move(s); }
  // kTensor: how it is rendered (a plain copy when never set).
  const SegmentRender& render() const {
    static const SegmentRender kPlain;
    const auto* p = std::get_if<std::shared_ptr<const SegmentRender>>(&data_);
    return p != nullptr ? **p : kPlain;
  }
  void set_render(const SegmentRender& r) { data_ = std::make_shared<const SegmentRender>(r); }
  const Transpose& how() const { return render().how; }
  double scale() const { return render().scale; }
  double add() const { return render().add; }
  bool Affine() const { return scale() != 1.0 || add() != 0.0; }
  const Box* box_or_null() const { return boxes.empty() ? nullptr : &boxes[0]; }

 private:
  std::variant<std::monostate, std::shared_ptr<const std::string>, std::shared_ptr<const SpooledBytes>,
               std::shared_ptr<const SegmentRender>>
      data_;
};
static_assert(sizeof(Segment) <= 64, "a Segment is kept per chunk: keep it small");

// A segment of literal bytes.
inline Segment LiteralSegment(std::string s) {
  Segment seg;
  seg.kind = SegmentKind::kLiteral;
  seg.size = s.size();
  seg.set_literal(std::move(s));
  return seg;
}

struct FileLayout {
  std::vector<Segment> segments;
  std::vector<uint64_t> starts;  // file offset of each segment (reads find theirs by binary search)
  uint64_t size = 0;
  void Add(Segment s) {
    starts.push_back(size);
    size += s.size;
    segments.push_back(std::move(s));
  }
  // The layout of `segs` laid end to end (they are moved in, not copied).
  static FileLayout Of(std::vector<Segment> segs) {
    FileLayout l;
    l.starts.reserve(segs.size());
    for (const Segment& s : segs) {
      l.starts.push_back(l.size);
      l.size += s.size;
    }
    l.segments = std::move(segs);
    return l;
  }
};

inline constexpr uint64_t kRootIno = 1;

// A node is ~100 bytes plus its name: a mount of a 100k-tensor checkpoint has
// 400k of them. Files whose bytes follow from one tensor record (params/ and
// other/ .npy / .raw, info.json) keep no layout until first used.
struct Node {
  enum class Lazy : uint8_t {
    kNo,    // the layout was made with the node
    kInfo,  // params/<fqn>/info.json (View::InfoJson)
    kNpy,   // <stem>.npy of `tensor`: the .npy header, then the tensor in its numpy dtype
    kRaw,   // <stem>.raw of `tensor`: its source bytes
  };
  uint64_t ino = 0;
  uint64_t parent = 0;
  std::string name;
  bool is_dir = false;
  Lazy lazy = Lazy::kNo;
  bool made = false;  // lazy: `layout` is made (under View::lazy_mu_)
  // .ckptfs/report.json: its bytes come from `ckptfs verify`, which the
  // filesystem core runs on first use (the layout stays empty).
  bool report = false;
  // .ckptfs/stats: the filesystem core's live counters (Filesystem::StatsJson).
  // Found by name but never listed (as JuiceFS's .stats): its bytes differ
  // between any two mounts and between two reads, so `diff -r`, `cp -r` and
  // `rsync` of mounts must not meet it.
  bool stats = false;
  // other/<key> of a record whose bytes other records serve too (a Megatron
  // layer stack, TensorRecord::alias): found by name, never listed.
  bool unlisted = false;
  // topo/ERRORS: its bytes are View::TopoErrors() at the time of the read.
  bool topo_errors = false;
  // kNpy / kRaw of a padded vocabulary (TensorRecord::VocabPadded): the
  // padding rows (<state>.vocab_padding.*); without it, the vocabulary's.
  bool vocab_padding = false;
  uint32_t subdirs = 0;  // directories: for st_nlink
  TensorId tensor;       // the tensor behind a file, for error reports
  // Lazy info.json: the size its layout will have, once asked (View::Size).
  uint64_t lazy_size = UINT64_MAX;
  std::vector<uint64_t> children;      // directories: child inodes, sorted by name
  std::unique_ptr<FileLayout> layout;  // files (lazy ones: once made)
};

class View {
 public:
  static Result<std::unique_ptr<View>> Build(const Index& index, const TopoOptions& topo = {});

  const Node* Get(uint64_t ino) const;
  // A missing topo/<name> with a valid name is planned and added here; a plan
  // that fails (a dimension that does not divide) is logged, listed in
  // topo/ERRORS and answered with nullptr (ENOENT).
  const Node* Lookup(uint64_t parent, std::string_view name) const;
  // A directory's children (name, inode, is_dir), and its link count.
  std::vector<std::tuple<std::string, uint64_t, bool>> List(uint64_t ino) const;
  // A page of a directory for FUSE listings, which resume at an offset
  // without an open handle: children from position `from` on, at most `max`.
  // Positions stay valid while the view lives. topo/, the one directory that
  // gains entries after Build (in name order), is paged in the order its
  // entries were made, so a new one comes last and never shifts a position.
  struct Child {
    std::string name;
    uint64_t ino = 0;
    bool is_dir = false;
    uint64_t next = 0;  // the position after this child
  };
  std::vector<Child> ListFrom(uint64_t ino, uint64_t from, size_t max) const;
  // When a directory last gained an entry after Build (ns since the epoch),
  // or 0: its mtime then, so the kernel drops its cached listing.
  uint64_t ChangedNs(uint64_t ino) const {
    return ino == topo_dir_ ? topo_changed_ns_.load(std::memory_order_acquire) : 0;
  }
  uint32_t NLink(uint64_t ino) const;
  // topo/ and topo/ERRORS change while mounted.
  bool Dynamic(uint64_t ino) const;
  // topo/ERRORS: one line per failed topo/ lookup, "topo/<name>: <reason>".
  std::string TopoErrors() const;
  // "params/w/param.npy" -> inode (no leading slash needed).
  Result<uint64_t> Resolve(std::string_view path) const;
  // The layout of a file, making it on first use.
  Result<const FileLayout*> Layout(uint64_t ino) const;
  // The layout of a kArchive segment's archive (literals, the tensor, its
  // CRC-32s), `s.size` bytes: made again at each call (callers cache it).
  Result<FileLayout> ArchiveLayout(const Segment& s) const;
  // A file's size: a lazy file's is computed from the index records alone
  // (an info.json's fragment lists are not read), so `ls -l` does no
  // per-file I/O.
  Result<uint64_t> Size(uint64_t ino) const;
  // Path of a node, for log lines.
  std::string PathOf(uint64_t ino) const;
  // The file after `ino` in a depth-first walk of the tree that takes each
  // directory's entries in name order (ls -R, tar, rsync, diff -r) or in
  // inode order (GNU cp -r sorts each listing by inode number), or 0 when
  // the walk ends or leaves more than 64 directories without meeting one.
  // Files found by name only (.ckptfs/stats, aliases), .ckptfs/report.json
  // and topo/ERRORS are not part of any walk. Plans nothing: a directory
  // whose files are made on first use (hf/, dcp/) is empty until then.
  // Cross-file read-ahead asks it (read_ahead.h).
  enum class WalkOrder : uint8_t { kName, kInode };
  uint64_t NextInWalk(uint64_t ino, WalkOrder order) const;
  size_t num_nodes() const { return nodes_.size(); }
  // Plans the views whose plans are kept beside the index (dcp/, a family's
  // DCP profile, hf/; views/plan_cache.h) as their first listing would,
  // so that every mount lists them from the saved plans (`ckptfs index
  // --plan-views`). Returns the plan files beside the index afterwards.
  std::vector<std::string> PlanSavedViews() const;

 private:
  View(const Index& index, TopoOptions topo) : index_(index), topo_(std::move(topo)) {}
  // Under tree_mu_ (exclusive) or before the view is shared.
  uint64_t AddDir(uint64_t parent, const std::string& name);
  Status AddTopo(const Topology& t);  // topo/<t.Name()>/ and its files
  // The files of directory `dir` (also linked into `links`), planned once on
  // first use by `plan` under tree_mu_; a failure is logged and becomes
  // <dir>/ERRORS saying `what` is not available. Nothing when dir is 0.
  using NamedFiles = std::vector<std::pair<std::string, FileLayout>>;
  void PlanOnce(std::atomic<bool>& made, uint64_t dir, const std::vector<uint64_t>& links, const std::string& what,
                const std::function<Result<NamedFiles>()>& plan) const;
  // hf/'s files, planned on first use (a failure is logged and becomes hf/ERRORS).
  void EnsureHf() const;
  // dcp/'s files, likewise (dcp_view.h), and their links under accelerate/.
  void EnsureDcp() const;
  // The profile's DCP files, likewise (dcp_view.h ProfileFiles).
  void EnsureProfile() const;
  // The name its plan is saved under ("" without a profile).
  std::string ProfilePlanName() const;
  const Node* GetLocked(uint64_t ino) const;
  std::string PathOfLocked(uint64_t ino) const;
  uint64_t AddFile(uint64_t parent, const std::string& name, FileLayout layout, TensorId tensor,
                   Node::Lazy lazy = Node::Lazy::kNo);
  uint64_t AddNode(uint64_t parent, std::string name, bool is_dir);
  // Node `ino` listed in directory `dir` (0: none) in name order: AddNode's
  // insertion after Build, and a hard link of a file made elsewhere (its
  // parent stays the first directory). Under tree_mu_, after Build.
  void Link(uint64_t dir, uint64_t ino);
  // The child of `dir` named `name`, or 0. Under tree_mu_ or while building.
  uint64_t FindChild(const Node& dir, std::string_view name) const;
  // A lazy .npy / .raw layout, from the tensor record alone.
  FileLayout TensorFileLayout(const Node& n) const;
  // info.json of a parameter directory into `out`; or, with `size_only` (and
  // `out` null), nothing is made: its size is added there (the fragment
  // lists' from their recorded lengths).
  Status InfoJson(const Node& n, FileLayout* out, uint64_t* size_only) const;
  Status AddExport(uint64_t root, const ExportFile& x);

  // NextInWalk's step to the child of `dir` after `after` (0: its first) in
  // `order`, skipping what no walk meets. Under tree_mu_ (shared).
  uint64_t NextChildLocked(const Node& dir, uint64_t after, WalkOrder order) const;

  const Index& index_;
  const TopoOptions topo_;
  // Guards nodes_ (append-only), directories' children and subdirs, and
  // topo_errors_. Taken before lazy_mu_, never after it.
  mutable std::shared_mutex tree_mu_;
  std::vector<std::unique_ptr<Node>> nodes_;  // ino - 1
  // While Build runs, children are appended unsorted and found here; Build
  // sorts them once at the end. Later additions (topo/, hf/) insert in order.
  struct ChildKey {
    uint64_t parent;
    std::string_view name;  // the child's own Node::name (nodes never move)
    bool operator==(const ChildKey&) const = default;
  };
  struct ChildKeyHash {
    size_t operator()(const ChildKey& k) const {
      return std::hash<std::string_view>{}(k.name) ^ (k.parent * 0x9e3779b97f4a7c15ull);
    }
  };
  std::unique_ptr<std::unordered_map<ChildKey, uint64_t, ChildKeyHash>> building_;
  static constexpr size_t kScanChildren = 8;
  // NextInWalk in inode order: the children of the last few big directories
  // it walked, sorted by inode (with the child count they were made at; only
  // topo/ grows). Leaf lock, taken under tree_mu_.
  mutable std::mutex walk_mu_;
  mutable std::vector<std::pair<uint64_t, std::shared_ptr<const std::vector<uint64_t>>>> by_inode_;
  uint64_t topo_dir_ = 0;
  mutable std::atomic<uint64_t> topo_changed_ns_{0};
  mutable std::atomic<bool> topo_listed_{false};  // ListFrom has paged topo/
  uint64_t hf_dir_ = 0;
  mutable std::atomic<bool> hf_made_{false};
  uint64_t dcp_dir_ = 0;  // 0: no dcp/ (a checkpoint without tensors)
  mutable std::atomic<bool> dcp_made_{false};
  // accelerate/pytorch_model_fsdp_0/ and accelerate/optimizer_0/ (with dcp/):
  // dcp/'s files linked in once dcp/ is made (the same nodes, as hard links).
  uint64_t accelerate_model_dir_ = 0, accelerate_optim_dir_ = 0;
  bool IsDcpDir(uint64_t ino) const {
    return ino != 0 && (ino == dcp_dir_ || ino == accelerate_model_dir_ || ino == accelerate_optim_dir_);
  }
  // A family's DCP profile (torch_dist/): its directory and the DCP's inside
  // it, planned on first use (EnsureProfile); or the profile's name and why
  // this checkpoint has none.
  std::shared_ptr<const DcpProfile> profile_;
  uint64_t profile_dir_ = 0, profile_dcp_dir_ = 0;
  mutable std::atomic<bool> profile_made_{false};
  std::pair<std::string, std::string> profile_absent_;
  std::map<std::string, std::string> topo_errors_;  // failed topo/ names -> why
  // Guards lazy layouts. Leaf lock: nothing else is taken while it is held.
  mutable std::mutex lazy_mu_;
  std::vector<std::string> problems_;
};

// Sanitizes a checkpoint key into one path component ('/' -> "%2F").
std::string PathComponent(std::string_view key);

// dcp/'s plan (src/views/dcp_view.h lays its files out from it): each key
// dcp/ offers, the tensor and chunks behind it, and what it leaves out. The
// Python package's StorageReader(view="dcp") answers from the same plan.
namespace dcp_view {
// A state-dict path element: a dict key, or a list index.
using PathElem = std::variant<std::string, int64_t>;

// One key of dcp/ and the tensor behind it.
struct DcpEntry {
  static constexpr uint32_t kLiteral = UINT32_MAX;
  std::string key;             // the flattened key dcp.load plans with
  std::vector<PathElem> path;  // planner_data: the key's path in the nested state dict
  uint32_t tensor = 0;         // Checkpoint::tensors index, or kLiteral
  // tensor == kLiteral: a bytes entry the family reader made (an internal
  // export "@dcp/<key>": DeepSpeed's param groups), these bytes.
  std::string literal;
  std::vector<Box> chunks;  // tensors: the chunk boxes (empty for bytes entries)
  // tensors: the key's global shape and element type (dcp/: the tensor's
  // shape as params/ serves it).
  std::vector<int64_t> size;
  DType dtype = DType::kInvalid;
  // A stack (a DcpProfile's layers, experts; stacked_axes > 0): chunk c is a
  // box of tensor chunk_tensors[c] with `stacked_axes` stack axes first
  // (their offsets the layer and expert, their lengths 1). Otherwise every
  // chunk is a box of `tensor` itself and chunk_tensors is empty.
  std::vector<uint32_t> chunk_tensors;
  uint8_t stacked_axes = 0;
  // The same items under a second key (optimizer.state.<fqn>.<state>):
  // more metadata, nothing more to read for any plan. Empty: none.
  std::string alias;
  std::vector<PathElem> alias_path;
};

// What dcp/ offers, without its files: the keys in order, what is left out.
// The Python package's StorageReader(view="dcp") answers from this too.
struct DcpPlan {
  std::vector<DcpEntry> entries;  // sorted by key
  std::vector<std::string> left_out;
  uint64_t chunks = 0;
  size_t from_master = 0;  // model.<fqn> keys read from fp32 masters
};
Result<DcpPlan> PlanDcp(const Index& index);
// The bytes entries a family reader made for dcp/ (internal exports
// "@dcp/<key>" of literal bytes: DeepSpeed's, verl's and Megatron's param
// groups), as (key, bytes) in export order; one that is not literal bytes is
// named in `left_out` ("<key>: <why>"). Nothing is planned or read; the
// Python package's StorageReader(view="params") offers them too.
std::vector<std::pair<std::string, std::string>> FamilyEntries(const Index& index, std::vector<std::string>* left_out);
// A family's DCP profile (formats.h DcpProfile) as a plan: its tensors'
// keys (stacked where it says so) at their stored rows, its objects as
// literal bytes entries.
Result<DcpPlan> PlanProfile(const Index& index, const DcpProfile& profile);
}  // namespace dcp_view

}  // namespace ckptfs

#endif  // CKPTFS_VIEWS_H_

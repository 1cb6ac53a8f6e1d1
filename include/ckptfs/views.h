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
//        params/<fqn>/info.json, other/<key>[.npy|.raw], .ckptfs/report.json,
//        and the family reader's synthesized files (ExportFile: universal/,
//        latest_universal).
#ifndef CKPTFS_VIEWS_H_
#define CKPTFS_VIEWS_H_

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/common.h"
#include "ckptfs/index.h"
#include "ckptfs/model.h"

namespace ckptfs {

enum class SegmentKind : uint8_t { kLiteral, kTensor, kHash, kCrc32 };

struct Segment {
  SegmentKind kind = SegmentKind::kLiteral;
  uint64_t size = 0;
  std::string literal;          // kLiteral
  TensorId tensor;              // kTensor, kHash, kCrc32
  DType out_dtype = DType::kInvalid;  // kTensor, kCrc32: element type written
  Box box;                      // kTensor, kCrc32: only this sub-box (empty: all)
  const Box* box_or_null() const { return box.offsets.empty() && box.lengths.empty() ? nullptr : &box; }
};

struct FileLayout {
  std::vector<Segment> segments;
  std::vector<uint64_t> starts;  // file offset of each segment (reads find theirs by binary search)
  uint64_t size = 0;
  void Add(Segment s) {
    starts.push_back(size);
    size += s.size;
    segments.push_back(std::move(s));
  }
};

inline constexpr uint64_t kRootIno = 1;

struct Node {
  uint64_t ino = 0;
  uint64_t parent = 0;
  std::string name;
  bool is_dir = false;
  std::map<std::string, uint64_t, std::less<>> children;  // directories
  uint32_t subdirs = 0;                                      // directories: for st_nlink
  // Files: the layout; when `lazy`, made on first use under View::lazy_mu_
  // (`made` says it is done; both only change under that lock).
  FileLayout layout;
  bool lazy = false;
  bool made = false;
  TensorId tensor;  // the tensor behind a file, for error reports
  // .ckptfs/report.json: its bytes come from `ckptfs verify`, which the
  // filesystem core runs on first use (the layout stays empty).
  bool report = false;
};

class View {
 public:
  static Result<std::unique_ptr<View>> Build(const Index& index);

  const Node* Get(uint64_t ino) const;
  const Node* Lookup(uint64_t parent, std::string_view name) const;
  // "params/w/param.npy" -> inode (no leading slash needed).
  Result<uint64_t> Resolve(std::string_view path) const;
  // The layout of a file, making it on first use.
  Result<const FileLayout*> Layout(uint64_t ino) const;
  // Path of a node, for log lines.
  std::string PathOf(uint64_t ino) const;
  size_t num_nodes() const { return nodes_.size(); }

 private:
  explicit View(const Index& index) : index_(index) {}
  uint64_t AddDir(uint64_t parent, const std::string& name);
  uint64_t AddFile(uint64_t parent, const std::string& name, FileLayout layout, TensorId tensor, bool lazy);
  Status MakeInfoJson(Node& n) const;
  Status AddExport(uint64_t root, const ExportFile& x);

  const Index& index_;
  std::vector<std::unique_ptr<Node>> nodes_;  // ino - 1
  // Guards lazy layouts. Leaf lock: nothing else is taken while it is held.
  mutable std::mutex lazy_mu_;
  std::vector<std::string> problems_;
};

// Sanitizes a checkpoint key into one path component ('/' -> "%2F").
std::string PathComponent(std::string_view key);

}  // namespace ckptfs

#endif  // CKPTFS_VIEWS_H_

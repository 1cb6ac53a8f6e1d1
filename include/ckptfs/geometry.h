// Element geometry shared by the readers (which map flat ranges to boxes at
// index time) and the read engine (which splits a byte range into boxes).
#ifndef CKPTFS_GEOMETRY_H_
#define CKPTFS_GEOMETRY_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace ckptfs {

// An N-d box of elements: offsets and lengths per dimension.
struct Box {
  std::vector<int64_t> offsets, lengths;
  bool operator==(const Box&) const = default;
};

// A transposed rendering of boxes of one tensor: each box, in C order, is a
// matrix whose columns are its last `col_axes` axes (the rest are its rows);
// the boxes' rows are concatenated and the whole transposed. `rope_group` > 0:
// then each group of that many output rows (a rotary head's dimensions) is
// reordered from interleaved pairs to halves: rows 0, 2, .., g-2, 1, 3, .., g-1.
struct Transpose {
  uint32_t col_axes = 1;
  uint32_t rope_group = 0;
  bool operator==(const Transpose&) const = default;
};

// Row-major (C order) element strides of `shape`.
std::vector<int64_t> ContiguousStrides(const std::vector<int64_t>& shape);
int64_t NumelOf(const std::vector<int64_t>& shape);
// "[2, 3]", for messages.
std::string ShapeStr(const std::vector<int64_t>& shape);
// Element offset of index `idx` under `strides`.
int64_t FlatIndex(const std::vector<int64_t>& idx, const std::vector<int64_t>& strides);

// Splits the flat element range [begin, end) of a row-major tensor of `shape`
// into at most 2*rank disjoint boxes, in flat order.
std::vector<Box> DecomposeRange(const std::vector<int64_t>& shape, uint64_t begin, uint64_t end);

// How a set of boxes covers a tensor of `shape`: the elements in no box
// (holes) and the regions in more than one (overlaps), with coordinates.
// Holes are found by box subtraction; when that would exceed `max_pieces`
// boxes the hole list is cut and `exact` is false (the counts still are).
struct Coverage {
  uint64_t uncovered = 0;  // elements in no box
  std::vector<Box> holes;  // at most max_report of them
  struct Overlap {
    size_t a = 0, b = 0;  // indices into the input boxes
    Box box;              // their intersection
  };
  uint64_t overlap_pairs = 0;
  std::vector<Overlap> overlaps;  // at most max_report of them
  bool exact = true;
  bool clean() const { return uncovered == 0 && overlap_pairs == 0; }
};
Coverage AnalyzeCoverage(const std::vector<int64_t>& shape, const std::vector<Box>& boxes, size_t max_report = 16,
                         size_t max_pieces = 1 << 16);
// A coverage defect in words and as a JSON object ({"shape", "uncovered_elements",
// "holes", "overlaps": [{"region", "files"}]}); `where(i)` names the file of
// input box i, `what` the boxes ("chunks", "fragments").
struct CoverageText {
  std::string message, detail;
};
CoverageText DescribeCoverage(const Coverage& c, const std::vector<int64_t>& shape,
                              const std::function<std::string(size_t)>& where, const std::string& what);
// "[o0:o0+l0, o1:o1+l1]": numpy slice notation of a box.
std::string BoxString(const Box& b);

}  // namespace ckptfs

#endif  // CKPTFS_GEOMETRY_H_

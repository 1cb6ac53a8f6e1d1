// Element geometry shared by the readers (which map flat ranges to boxes at
// index time) and the read engine (which splits a byte range into boxes).
#ifndef CKPTFS_GEOMETRY_H_
#define CKPTFS_GEOMETRY_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ckptfs {

// An N-d box of elements: offsets and lengths per dimension.
struct Box {
  std::vector<int64_t> offsets, lengths;
};

// Row-major (C order) element strides of `shape`.
std::vector<int64_t> ContiguousStrides(const std::vector<int64_t>& shape);
int64_t NumelOf(const std::vector<int64_t>& shape);
// Element offset of index `idx` under `strides`.
int64_t FlatIndex(const std::vector<int64_t>& idx, const std::vector<int64_t>& strides);

// Splits the flat element range [begin, end) of a row-major tensor of `shape`
// into at most 2*rank disjoint boxes, in flat order.
std::vector<Box> DecomposeRange(const std::vector<int64_t>& shape, uint64_t begin, uint64_t end);

}  // namespace ckptfs

#endif  // CKPTFS_GEOMETRY_H_

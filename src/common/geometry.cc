#include "ckptfs/geometry.h"

namespace ckptfs {
namespace {

void Decompose(const std::vector<int64_t>& shape, size_t dim, std::vector<int64_t>& prefix, uint64_t a, uint64_t b,
               std::vector<Box>& out) {
  if (a >= b) return;
  const size_t rank = shape.size();
  if (dim == rank) {  // 0-d tail: the single element
    Box bx;
    bx.offsets = prefix;
    bx.lengths.assign(rank, 1);
    out.push_back(std::move(bx));
    return;
  }
  uint64_t inner = 1;
  for (size_t d = dim + 1; d < rank; ++d) inner *= static_cast<uint64_t>(shape[d]);
  uint64_t ra = a / inner, rb = b / inner, oa = a % inner, ob = b % inner;
  auto full_box = [&](uint64_t r0, uint64_t r1) {
    Box bx;
    bx.offsets = prefix;
    bx.lengths.assign(prefix.size(), 1);
    bx.offsets.push_back(static_cast<int64_t>(r0));
    bx.lengths.push_back(static_cast<int64_t>(r1 - r0));
    for (size_t d = dim + 1; d < rank; ++d) {
      bx.offsets.push_back(0);
      bx.lengths.push_back(shape[d]);
    }
    out.push_back(std::move(bx));
  };
  auto sub = [&](uint64_t row, uint64_t lo, uint64_t hi) {
    prefix.push_back(static_cast<int64_t>(row));
    Decompose(shape, dim + 1, prefix, lo, hi, out);
    prefix.pop_back();
  };
  if (ra == rb) {
    sub(ra, oa, ob);
    return;
  }
  if (oa != 0) {
    sub(ra, oa, inner);
    ++ra;
  }
  if (ra < rb) full_box(ra, rb);
  if (ob != 0) sub(rb, 0, ob);
}

}  // namespace

std::vector<Box> DecomposeRange(const std::vector<int64_t>& shape, uint64_t begin, uint64_t end) {
  std::vector<Box> out;
  std::vector<int64_t> prefix;
  if (shape.empty()) {
    if (begin == 0 && end >= 1) out.push_back(Box{});
    return out;
  }
  Decompose(shape, 0, prefix, begin, end, out);
  return out;
}

std::vector<int64_t> ContiguousStrides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> s(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) s[d - 1] = s[d] * shape[d];
  return s;
}

int64_t NumelOf(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t x : shape) n *= x;
  return n;
}

int64_t FlatIndex(const std::vector<int64_t>& idx, const std::vector<int64_t>& strides) {
  int64_t f = 0;
  for (size_t d = 0; d < idx.size(); ++d) f += idx[d] * strides[d];
  return f;
}

}  // namespace ckptfs

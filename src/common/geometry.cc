#include "ckptfs/geometry.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "common/json_text.h"

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

std::string ShapeStr(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
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

namespace {

bool Intersect(const Box& a, const Box& b, Box* out) {
  const size_t rank = a.offsets.size();
  out->offsets.resize(rank);
  out->lengths.resize(rank);
  for (size_t d = 0; d < rank; ++d) {
    const int64_t lo = std::max(a.offsets[d], b.offsets[d]);
    const int64_t hi = std::min(a.offsets[d] + a.lengths[d], b.offsets[d] + b.lengths[d]);
    if (lo >= hi) return false;
    out->offsets[d] = lo;
    out->lengths[d] = hi - lo;
  }
  return true;
}

// Appends `a` minus `b` (at most 2*rank disjoint boxes) to `out`.
void Subtract(const Box& a, const Box& b, std::vector<Box>& out) {
  Box cut;
  if (!Intersect(a, b, &cut)) {
    out.push_back(a);
    return;
  }
  Box rest = a;  // shrinks dim by dim to the intersection
  for (size_t d = 0; d < a.offsets.size(); ++d) {
    const int64_t r0 = rest.offsets[d], r1 = rest.offsets[d] + rest.lengths[d];
    const int64_t c0 = cut.offsets[d], c1 = cut.offsets[d] + cut.lengths[d];
    if (c0 > r0) {
      Box lo = rest;
      lo.lengths[d] = c0 - r0;
      out.push_back(std::move(lo));
    }
    if (c1 < r1) {
      Box hi = rest;
      hi.offsets[d] = c1;
      hi.lengths[d] = r1 - c1;
      out.push_back(std::move(hi));
    }
    rest.offsets[d] = c0;
    rest.lengths[d] = c1 - c0;
  }
}

uint64_t Volume(const Box& b) {
  uint64_t v = 1;
  for (int64_t l : b.lengths) v *= static_cast<uint64_t>(std::max<int64_t>(l, 0));
  return v;
}

}  // namespace

Coverage AnalyzeCoverage(const std::vector<int64_t>& shape, const std::vector<Box>& boxes, size_t max_report,
                         size_t max_pieces) {
  Coverage c;
  const size_t rank = shape.size();
  Box full;
  full.offsets.assign(rank, 0);
  full.lengths = shape;
  if (Volume(full) == 0) return c;

  // Overlaps: sweep along dim 0 (boxes sorted by their start there).
  std::vector<size_t> order(boxes.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  auto start = [&](size_t i) { return rank ? boxes[i].offsets[0] : 0; };
  auto end = [&](size_t i) { return rank ? boxes[i].offsets[0] + boxes[i].lengths[0] : 1; };
  std::sort(order.begin(), order.end(), [&](size_t x, size_t y) { return start(x) < start(y); });
  uint64_t covered = 0, overlap_volume = 0;  // covered - overlap_volume: exact without triple overlaps
  for (size_t i = 0; i < order.size(); ++i) {
    const size_t a = order[i];
    Box in_tensor;
    if (!Intersect(boxes[a], full, &in_tensor)) continue;
    covered += Volume(in_tensor);
    for (size_t j = i + 1; j < order.size() && start(order[j]) < end(a); ++j) {
      Box ov;
      if (!Intersect(boxes[a], boxes[order[j]], &ov) || Volume(ov) == 0) continue;
      ++c.overlap_pairs;
      overlap_volume += Volume(ov);
      if (c.overlaps.size() < max_report) c.overlaps.push_back({std::min(a, order[j]), std::max(a, order[j]), ov});
    }
  }

  // Holes: the full box minus every input box.
  std::vector<Box> left = {full}, next;
  for (const Box& b : boxes) {
    if (left.empty()) break;
    next.clear();
    for (const Box& piece : left) Subtract(piece, b, next);
    left.swap(next);
    if (left.size() > max_pieces) {
      c.exact = false;
      break;
    }
  }
  if (c.exact) {
    for (const Box& h : left) c.uncovered += Volume(h);
  } else {
    const uint64_t numel = Volume(full);
    covered = covered >= overlap_volume ? covered - overlap_volume : 0;
    c.uncovered = covered >= numel ? 0 : numel - covered;
  }
  if (c.uncovered > 0) {
    for (size_t i = 0; i < left.size() && c.holes.size() < max_report; ++i) c.holes.push_back(left[i]);
  }
  return c;
}

CoverageText DescribeCoverage(const Coverage& c, const std::vector<int64_t>& shape,
                              const std::function<std::string(size_t)>& where, const std::string& what) {
  nlohmann::ordered_json j;
  j["shape"] = shape;
  std::string msg;
  if (c.uncovered) {
    j["uncovered_elements"] = c.uncovered;
    j["holes"] = nlohmann::ordered_json::array();
    for (const Box& h : c.holes) j["holes"].push_back(BoxString(h));
    msg = std::to_string(c.uncovered) + " of " + std::to_string(NumelOf(shape)) + " elements are in no " +
          what.substr(0, what.size() - 1) + (c.holes.empty() ? "" : " (first hole " + BoxString(c.holes.front()) + ")");
  }
  if (c.overlap_pairs) {
    j["overlaps"] = nlohmann::ordered_json::array();
    for (const auto& o : c.overlaps) {
      j["overlaps"].push_back({{"region", BoxString(o.box)}, {"files", {where(o.a), where(o.b)}}});
    }
    const auto& o = c.overlaps.front();
    msg += std::string(msg.empty() ? "" : "; ") + std::to_string(c.overlap_pairs) + " pair(s) of " + what +
           " overlap (first " + BoxString(o.box) + ", in " + where(o.a) + " and " + where(o.b) + ")";
  }
  return {msg, JsonText(j)};
}

std::string BoxString(const Box& b) {
  std::string s = "[";
  for (size_t d = 0; d < b.offsets.size(); ++d) {
    if (d) s += ", ";
    s += std::to_string(b.offsets[d]) + ":" + std::to_string(b.offsets[d] + b.lengths[d]);
  }
  return s + "]";
}

}  // namespace ckptfs

// Transposed reads (ReadTransposedRows: Hugging Face Conv1D weights, Flax
// kernels as Linear weights): output rows are cut into fixed slabs of about
// 4 MiB, each read through ReadBox and transposed in tiles (then, for a
// rotary group, reordered within each group); the last kTransposedSlabs slabs
// are kept, and a kept one is served only after its source files pass CheckFd. Locking: slab_mu_ (a
// leaf) guards slabs_ and spare_slab_bytes_; it is not held while reading.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <set>

#include "ckptfs/io.h"

namespace ckptfs {

namespace {

// dst[j][c0 + i] = src[i][j] for an [h, w] C-order block of T elements,
// into rows of `stride` elements. In 64 x 64 tiles: a row-by-row walk writes
// each element to another cache line (rows of a transposed weight are
// kilobytes apart), which made the transpose, not the I/O, the cost of a read.
template <typename T>
void TransposeBlock(const char* src_bytes, uint64_t h, uint64_t w, char* dst_bytes, uint64_t stride, uint64_t c0) {
  constexpr uint64_t kTile = 64;
  const T* src = reinterpret_cast<const T*>(src_bytes);
  T* dst = reinterpret_cast<T*>(dst_bytes);
  for (uint64_t i0 = 0; i0 < h; i0 += kTile) {
    const uint64_t i1 = std::min(h, i0 + kTile);
    for (uint64_t j0 = 0; j0 < w; j0 += kTile) {
      const uint64_t j1 = std::min(w, j0 + kTile);
      for (uint64_t j = j0; j < j1; ++j) {
        T* d = dst + j * stride + c0;
        const T* s = src + j;
        for (uint64_t i = i0; i < i1; ++i) d[i] = s[i * w];
      }
    }
  }
}

}  // namespace

Result<std::shared_ptr<const TensorReader::TransposedSlab>> TensorReader::Slab(TensorId id, DType out,
                                                                               const std::vector<Box>& rows,
                                                                               const Transpose& how, uint64_t r0,
                                                                               uint64_t r1, uint64_t total) {
  auto same = [&](const TransposedSlab& s) {
    return s.id.v == id.v && s.out == out && s.r0 == r0 && s.r1 == r1 && s.how == how && s.rows == rows;
  };
  std::shared_ptr<const TransposedSlab> hit;
  {
    std::lock_guard<std::mutex> lock(slab_mu_);
    for (size_t i = 0; i < slabs_.size(); ++i) {
      if (!same(*slabs_[i])) continue;
      hit = slabs_[i];
      std::rotate(slabs_.begin(), slabs_.begin() + static_cast<std::ptrdiff_t>(i),
                  slabs_.begin() + static_cast<std::ptrdiff_t>(i) + 1);
      break;
    }
  }
  if (hit) {  // read before: its sources must still be the indexed ones
    ASSIGN_OR_RETURN(auto frags, FragmentsOf(id));
    std::set<uint32_t> seen;
    for (const Fragment& f : *frags) {
      if (seen.insert(f.file.v).second) RETURN_IF_ERROR(CheckFd(f.file));
    }
    return hit;
  }
  auto slab = std::make_shared<TransposedSlab>();
  {
    std::lock_guard<std::mutex> lock(slab_mu_);
    slab->bytes.swap(spare_slab_bytes_);  // an evicted slab's pages: no fresh page faults
  }
  slab->id = id;
  slab->out = out;
  slab->rows = rows;
  slab->how = how;
  slab->r0 = r0;
  slab->r1 = r1;
  const uint64_t osz = DTypeSize(out), w = r1 - r0;
  slab->bytes.resize(w * total * osz);
  // A FUSE worker's scratch (at most one slab, ~4 MiB), kept between reads:
  // a fresh one costs its page faults on every slab.
  thread_local std::vector<char> block;
  uint64_t c0 = 0;
  for (const Box& b : rows) {
    // Columns [r0, r1) of this box: a range of its first column axis (the
    // caller cut slabs at multiples of the axes after it), the rest whole.
    const size_t a = b.lengths.size() - how.col_axes;
    uint64_t inner = 1, h = 1;
    for (size_t d = a + 1; d < b.lengths.size(); ++d) inner *= static_cast<uint64_t>(b.lengths[d]);
    for (size_t d = 0; d < a; ++d) h *= static_cast<uint64_t>(b.lengths[d]);
    if (h == 0) continue;
    Box sub = b;
    sub.offsets[a] += static_cast<int64_t>(r0 / inner);
    sub.lengths[a] = static_cast<int64_t>(w / inner);
    block.resize(h * w * osz);
    RETURN_IF_ERROR(ReadBox(id, out, &sub, 0, block.size(), block.data()));
    char* dst = slab->bytes.data();
    switch (osz) {
      case 1:
        TransposeBlock<uint8_t>(block.data(), h, w, dst, total, c0);
        break;
      case 2:
        TransposeBlock<uint16_t>(block.data(), h, w, dst, total, c0);
        break;
      case 4:
        TransposeBlock<uint32_t>(block.data(), h, w, dst, total, c0);
        break;
      default:
        TransposeBlock<uint64_t>(block.data(), h, w, dst, total, c0);
        break;
    }
    c0 += h;
  }
  if (how.rope_group > 0) {  // interleaved pairs to halves, per group of output rows
    const uint64_t g = how.rope_group, row = total * osz;
    block.resize(g * row);
    for (uint64_t first = 0; first < w; first += g) {
      char* grp = slab->bytes.data() + first * row;
      std::memcpy(block.data(), grp, g * row);
      for (uint64_t i = 0; i < g; ++i) {
        const uint64_t from = i < g / 2 ? 2 * i : 2 * (i - g / 2) + 1;
        std::memcpy(grp + i * row, block.data() + from * row, row);
      }
    }
  }
  std::lock_guard<std::mutex> lock(slab_mu_);
  slabs_.insert(slabs_.begin(), slab);
  if (slabs_.size() > kTransposedSlabs) {
    if (slabs_.back().use_count() == 1) spare_slab_bytes_.swap(slabs_.back()->bytes);
    slabs_.pop_back();
  }
  return std::shared_ptr<const TransposedSlab>(slab);
}

Status TensorReader::ReadTransposedRows(TensorId id, DType out, const std::vector<Box>& rows, const Transpose& how,
                                        uint64_t offset, uint64_t len, char* dst) {
  if (id.v >= index_.tensors().size()) return Internal("tensor id out of range");
  const TensorRecord& t = index_.tensors()[id.v];
  const uint64_t osz = DTypeSize(out);
  const size_t rank = t.shape.size();
  if (rows.empty() || how.col_axes == 0 || how.col_axes >= rank || (osz != 1 && osz != 2 && osz != 4 && osz != 8)) {
    return Internal("cannot transpose '" + t.key + "': not boxes of a tensor of rank above " +
                    std::to_string(how.col_axes) + " of a 1-, 2-, 4- or 8-byte type");
  }
  // Every box: inside the tensor, the same columns, the axes after the first
  // column axis whole (so a range of columns is a box).
  const size_t a = rank - how.col_axes;
  uint64_t cols = 0, inner = 1, total = 0;  // total: rows of the concatenation, the transpose's row length
  for (size_t i = 0; i < rows.size(); ++i) {
    const Box& b = rows[i];
    bool ok = b.offsets.size() == rank && b.lengths.size() == rank;
    for (size_t d = 0; ok && d < rank; ++d) {
      ok = b.offsets[d] >= 0 && b.lengths[d] >= 0 && b.offsets[d] <= t.shape[d] &&
           b.lengths[d] <= t.shape[d] - b.offsets[d] && (d <= a || (b.offsets[d] == 0 && b.lengths[d] == t.shape[d])) &&
           (d < a || b.lengths[d] == rows[0].lengths[d]);
    }
    if (!ok) return Internal("box " + BoxString(b) + " of '" + t.key + "' does not transpose with the others");
    uint64_t h = 1;
    for (size_t d = 0; d < a; ++d) h *= static_cast<uint64_t>(b.lengths[d]);
    total += h;
  }
  for (size_t d = a + 1; d < rank; ++d) inner *= static_cast<uint64_t>(t.shape[d]);
  cols = static_cast<uint64_t>(rows[0].lengths[a]) * inner;
  if (how.rope_group > 0 && (how.rope_group % 2 != 0 || cols % how.rope_group != 0)) {
    return Internal("cannot transpose '" + t.key + "': " + std::to_string(cols) + " columns are not groups of " +
                    std::to_string(how.rope_group));
  }
  if (len == 0) return Status::Ok();
  const uint64_t row_bytes = total * osz;
  if (row_bytes == 0 || offset + len > cols * row_bytes) {
    return Invalid("cannot read '" + t.key + "': range past the transposed tensor");
  }
  // Output rows (source columns) in fixed slabs of about 4 MiB, a multiple of
  // the columns one index of the first column axis spans and of the rotary
  // group: slab k holds rows [k * step, (k + 1) * step), so consecutive
  // requests find theirs kept.
  const uint64_t unit = std::lcm<uint64_t>(inner, std::max<uint64_t>(how.rope_group, 1));
  const uint64_t step = std::max<uint64_t>(1, (4ull << 20) / row_bytes / unit) * unit, end = offset + len;
  for (uint64_t k = offset / row_bytes / step; k * step * row_bytes < end; ++k) {
    const uint64_t r0 = k * step, r1 = std::min<uint64_t>(cols, r0 + step);
    ASSIGN_OR_RETURN(auto slab, Slab(id, out, rows, how, r0, r1, total));
    const uint64_t lo = std::max(offset, r0 * row_bytes), hi = std::min(end, r1 * row_bytes);
    std::memcpy(dst + (lo - offset), slab->bytes.data() + (lo - r0 * row_bytes), hi - lo);
  }
  return Status::Ok();
}

}  // namespace ckptfs

// Transposed reads (ReadTransposedRows: Hugging Face Conv1D weights): output
// rows are cut into fixed slabs of about 4 MiB, each read through ReadBox and
// transposed in tiles; the last kTransposedSlabs slabs are kept, and a kept one
// is served only after its source files pass CheckFd. Locking: slab_mu_ (a
// leaf) guards slabs_ and spare_slab_bytes_; it is not held while reading.
#include <algorithm>
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
                                                                               uint64_t r0, uint64_t r1,
                                                                               uint64_t total) {
  auto same = [&](const TransposedSlab& s) {
    return s.id.v == id.v && s.out == out && s.r0 == r0 && s.r1 == r1 && s.rows == rows;
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
  slab->r0 = r0;
  slab->r1 = r1;
  const uint64_t osz = DTypeSize(out), w = r1 - r0;
  slab->bytes.resize(w * total * osz);
  // A FUSE worker's scratch (at most one slab, ~4 MiB), kept between reads:
  // a fresh one costs its page faults on every slab.
  thread_local std::vector<char> block;
  uint64_t c0 = 0;
  for (const Box& b : rows) {
    const uint64_t h = static_cast<uint64_t>(b.lengths[0]);
    if (h == 0) continue;
    const Box sub{{b.offsets[0], static_cast<int64_t>(r0)}, {b.lengths[0], static_cast<int64_t>(w)}};
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
  std::lock_guard<std::mutex> lock(slab_mu_);
  slabs_.insert(slabs_.begin(), slab);
  if (slabs_.size() > kTransposedSlabs) {
    if (slabs_.back().use_count() == 1) spare_slab_bytes_.swap(slabs_.back()->bytes);
    slabs_.pop_back();
  }
  return std::shared_ptr<const TransposedSlab>(slab);
}

Status TensorReader::ReadTransposedRows(TensorId id, DType out, const std::vector<Box>& rows, uint64_t offset,
                                        uint64_t len, char* dst) {
  if (id.v >= index_.tensors().size()) return Internal("tensor id out of range");
  const TensorRecord& t = index_.tensors()[id.v];
  const uint64_t osz = DTypeSize(out);
  if (t.shape.size() != 2 || rows.empty() || (osz != 1 && osz != 2 && osz != 4 && osz != 8)) {
    return Internal("cannot transpose '" + t.key + "': not rows of a 2-D tensor of a 1-, 2-, 4- or 8-byte type");
  }
  const int64_t cols = t.shape[1];
  uint64_t total = 0;  // rows of the concatenation: the transpose's row length
  for (const Box& b : rows) {
    if (b.offsets.size() != 2 || b.lengths.size() != 2 || b.offsets[1] != 0 || b.lengths[1] != cols ||
        b.lengths[0] < 0 || b.offsets[0] < 0 || b.offsets[0] + b.lengths[0] > t.shape[0]) {
      return Internal("box " + BoxString(b) + " is not whole rows of '" + t.key + "'");
    }
    total += static_cast<uint64_t>(b.lengths[0]);
  }
  if (len == 0) return Status::Ok();
  const uint64_t row_bytes = total * osz;
  if (row_bytes == 0 || offset + len > static_cast<uint64_t>(cols) * row_bytes) {
    return Invalid("cannot read '" + t.key + "': range past the transposed tensor");
  }
  // Output rows (source columns) in fixed slabs of about 4 MiB: slab k holds
  // rows [k * step, (k + 1) * step), so consecutive requests find theirs kept.
  const uint64_t step = std::max<uint64_t>(1, (4ull << 20) / row_bytes), end = offset + len;
  for (uint64_t k = offset / row_bytes / step; k * step * row_bytes < end; ++k) {
    const uint64_t r0 = k * step, r1 = std::min<uint64_t>(static_cast<uint64_t>(cols), r0 + step);
    ASSIGN_OR_RETURN(auto slab, Slab(id, out, rows, r0, r1, total));
    const uint64_t lo = std::max(offset, r0 * row_bytes), hi = std::min(end, r1 * row_bytes);
    std::memcpy(dst + (lo - offset), slab->bytes.data() + (lo - r0 * row_bytes), hi - lo);
  }
  return Status::Ok();
}

}  // namespace ckptfs

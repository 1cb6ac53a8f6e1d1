#include "formats/tp_merge.h"

#include <algorithm>

namespace ckptfs::formats {

std::optional<int> LlamaLinearSplitDim(std::string_view fqn) {
  for (const char* col :
       {".wq.", ".wk.", ".wv.", ".w1.", ".w3.", ".q_proj.", ".k_proj.", ".v_proj.", ".gate_proj.", ".up_proj."}) {
    if (Contains(fqn, col)) return 0;
  }
  for (const char* row : {".wo.", ".w2.", ".o_proj.", ".down_proj."}) {
    if (Contains(fqn, row)) return EndsWith(fqn, ".bias") ? -1 : 1;
  }
  return std::nullopt;
}

TensorSplit SplitOf(const Rule& r) {
  TensorSplit s;
  switch (r.kind) {
    case Merge::kCat:
      s.kind = SplitKind::kDim;
      s.dim = r.cat_dim;
      s.pad_rows = r.vocab && r.cat_dim == 0;
      break;
    case Merge::kReplicated:
    case Merge::kAverage:
      s.kind = SplitKind::kReplicate;
      break;
    case Merge::kSub2:
      s.kind = SplitKind::kSub2;
      break;
    case Merge::kSubParams:
      break;  // not one of topo/'s split kinds
  }
  return s;
}

std::vector<int64_t> Merger::LocalShape(int t) const {
  if (rule_.kind == Merge::kSubParams) return rule_.sub.ViewShape(static_cast<size_t>(t));
  return local_[static_cast<size_t>(t)];
}

Result<std::vector<int64_t>> Merger::GlobalShape() const {
  const auto& l0 = local_[0];
  if (rule_.kind == Merge::kSubParams) {
    const SubParams& sp = rule_.sub;
    if (sp.dim < 0 || static_cast<size_t>(sp.dim) >= sp.logical.size() || sp.widths.size() != sp.sizes.size()) {
      return Invalid("sub-parameter shape without a partition dim " + std::to_string(sp.dim));
    }
    for (size_t j = 0; j < sp.widths.size(); ++j) {
      if (sp.widths[j].size() != local_.size()) return Invalid("sub-parameter widths for another TP degree");
    }
    for (size_t t = 0; t < local_.size(); ++t) {
      if (NumelOf(local_[t]) != NumelOf(sp.ViewShape(t))) {
        return Invalid("TP rank " + std::to_string(t) + " holds " + ShapeStr(local_[t]) +
                       ", but its sub-parameter widths describe " + ShapeStr(sp.ViewShape(t)));
      }
    }
    return sp.logical;
  }
  if (rule_.kind == Merge::kAverage) {
    for (const auto& l : local_) {
      if (l != l0) return Invalid("TP copies to average have different shapes " + ShapeStr(l0) + " and " + ShapeStr(l));
    }
    return l0;
  }
  if (rule_.kind == Merge::kReplicated || local_.size() == 1) {
    if (rule_.kind == Merge::kCat && l0.size() <= static_cast<size_t>(rule_.cat_dim)) {
      return Invalid("a tensor of shape " + ShapeStr(l0) + " cannot be concatenated on dim " +
                     std::to_string(rule_.cat_dim));
    }
    return l0;
  }
  const size_t dim = rule_.kind == Merge::kSub2 ? 0 : static_cast<size_t>(rule_.cat_dim);
  if (l0.size() <= dim) {
    return Invalid("a tensor of shape " + ShapeStr(l0) + " cannot be concatenated on dim " + std::to_string(dim));
  }
  std::vector<int64_t> g = l0;
  g[dim] = 0;
  for (const auto& l : local_) {
    if (l.size() != l0.size()) return Invalid("TP slices have different ranks");
    for (size_t d = 0; d < l.size(); ++d) {
      if (d != dim && l[d] != l0[d]) return Invalid("TP slices " + ShapeStr(l0) + " and " + ShapeStr(l) + " differ");
    }
    if (l[dim] != l0[dim]) return Unsupported("uneven TP slices along the merge dimension");
    if (rule_.kind == Merge::kSub2 && l[0] % 2 != 0) return Invalid("a two-sub-parameter slice has odd rows");
    g[dim] += l[dim];
  }
  return g;
}

std::vector<Placed> Merger::Place(int t, const Box& b) const {
  std::vector<Placed> out;
  auto emit = [&](Box g, std::vector<int64_t> local) { out.push_back(Placed{std::move(g), std::move(local)}); };
  if (rule_.kind == Merge::kReplicated || rule_.kind == Merge::kAverage || local_.size() == 1) {
    emit(b, b.offsets);
    return out;
  }
  if (rule_.kind == Merge::kSubParams) {
    const SubParams& sp = rule_.sub;
    const size_t d = static_cast<size_t>(sp.dim);
    const int64_t lo = b.offsets[d], hi = b.offsets[d] + b.lengths[d];
    int64_t own = 0, global = 0;  // start of sub-parameter j in rank t's view and in the merged tensor
    for (size_t j = 0; j < sp.sizes.size(); ++j) {
      int64_t before = 0;  // rows of sub-parameter j on lower ranks
      for (int r = 0; r < t; ++r) before += sp.widths[j][static_cast<size_t>(r)];
      const int64_t w = sp.widths[j][static_cast<size_t>(t)];
      const int64_t a = std::max(lo, own), z = std::min(hi, own + w);
      if (a < z) {
        Box g = b;
        g.offsets[d] = global + before + (a - own);
        g.lengths[d] = z - a;
        std::vector<int64_t> local = b.offsets;
        local[d] = a;
        emit(std::move(g), std::move(local));
      }
      own += w;
      global += sp.sizes[j];
    }
    return out;
  }
  if (rule_.kind == Merge::kSub2) {
    const int64_t h = local_[t][0] / 2, total_h = h * static_cast<int64_t>(local_.size());
    const int64_t lo = b.offsets[0], hi = b.offsets[0] + b.lengths[0];
    for (int half = 0; half < 2; ++half) {
      int64_t a = std::max(lo, half * h), z = std::min(hi, (half + 1) * h);
      if (a >= z) continue;
      Box g = b;
      g.offsets[0] = half * total_h + t * h + (a - half * h);
      g.lengths[0] = z - a;
      std::vector<int64_t> local = b.offsets;
      local[0] = a;
      emit(std::move(g), std::move(local));
    }
    return out;
  }
  Box g = b;
  g.offsets[rule_.cat_dim] += t * local_[t][rule_.cat_dim];
  emit(std::move(g), b.offsets);
  return out;
}

void AddRangeFragments(const Merger& m, int t, const std::vector<int64_t>& local_shape, int64_t start, int64_t numel,
                       FileId file, DType dt, uint64_t base, std::vector<Fragment>& out) {
  const auto strides = ContiguousStrides(local_shape);
  const uint64_t isz = DTypeSize(dt);
  for (const Box& b : DecomposeRange(local_shape, static_cast<uint64_t>(start), static_cast<uint64_t>(start + numel))) {
    for (Placed& p : m.Place(t, b)) {
      Fragment f;
      f.file = file;
      f.dtype = dt;
      f.strides = strides;
      const int64_t first = FlatIndex(p.local_offsets, strides);
      int64_t last = first;
      for (size_t d = 0; d < p.global.lengths.size(); ++d) last += (p.global.lengths[d] - 1) * strides[d];
      f.data_offset = base + static_cast<uint64_t>(first - start) * isz;
      f.data_length = static_cast<uint64_t>(last - first + 1) * isz;
      f.offsets = std::move(p.global.offsets);
      f.lengths = std::move(p.global.lengths);
      f.replica = m.CopyOf(t);
      out.push_back(std::move(f));
    }
  }
}

void AddWholeFragments(const Merger& m, int t, const Loc& stored, FileId file, std::vector<Fragment>& out) {
  if (stored.Numel() == 0) return;
  Loc l = stored;
  if (const auto view = m.LocalShape(t); view != l.shape && l.Contiguous() && NumelOf(view) == l.Numel()) {
    l.shape = view;  // a contiguous slice read through its sub-parameter view
    l.strides = ContiguousStrides(view);
  }
  Box whole;
  whole.offsets.assign(l.shape.size(), 0);
  whole.lengths = l.shape;
  for (Placed& pl : m.Place(t, whole)) {
    Fragment f;
    f.file = file;
    f.dtype = l.dtype;
    f.strides = l.strides;
    const uint64_t skip = static_cast<uint64_t>(FlatIndex(pl.local_offsets, l.strides)) * DTypeSize(l.dtype);
    f.data_offset = l.data_offset + skip;
    f.data_length = l.data_length - skip;
    f.offsets = std::move(pl.global.offsets);
    f.lengths = std::move(pl.global.lengths);
    f.replica = m.CopyOf(t);
    out.push_back(std::move(f));
  }
}

}  // namespace ckptfs::formats

// Read planning: the pieces in which a view's elements meet the fragments
// (VisitPieces: a hole or a short fragment is an error, never zeros), turned
// into a chunk's I/O and gather ops (PlanChunk) or, for plain copies and
// conversions, into runs of source spans (CollectRuns, PlanCopy, PlanConvert:
// false, never an error, when a read is not one). No locks of their own.
#include <algorithm>

#include "ckptfs/io.h"
#include "io/tensor_reader_internal.h"

namespace ckptfs {
namespace {

// Appends `op`, split along its outer dims while its rank is over what a
// GatherOp holds (tensors of more than 8 dims that do not coalesce).
void PushOp(GatherOp op, const std::vector<int64_t>& len, const std::vector<int64_t>& sstr,
            const std::vector<int64_t>& dstr, size_t from, uint64_t ssz, uint64_t dsz, std::vector<GatherOp>& ops) {
  if (len.size() - from > static_cast<size_t>(kMaxGatherDims)) {
    for (int64_t i = 0; i < len[from]; ++i) {
      GatherOp sub = op;
      sub.src_off += static_cast<uint64_t>(i * sstr[from]) * ssz;
      sub.dst_off += static_cast<uint64_t>(i * dstr[from]) * dsz;
      PushOp(sub, len, sstr, dstr, from + 1, ssz, dsz, ops);
    }
    return;
  }
  op.rank = static_cast<uint8_t>(len.size() - from);
  for (size_t d = from; d < len.size(); ++d) {
    op.len[d - from] = len[d], op.sstr[d - from] = sstr[d], op.dstr[d - from] = dstr[d];
  }
  ops.push_back(op);
}

// One intersection of a fragment with a box of the view, dims of length 1
// dropped and dims that step over each other merged: `len` elements per
// dim, `sstr` / `dstr` their strides in the fragment's storage and in the
// output (elements), from source byte `src_byte` of the fragment (relative to
// its data_offset) and output element `dst_elem` (relative to element e0).
struct Piece {
  const Fragment* f = nullptr;
  uint64_t src_byte = 0, span_bytes = 0, dst_elem = 0;
  std::vector<int64_t> len, sstr, dstr;
};

// A piece whose span is mostly gaps between its rows is cut into one piece
// per index of its outermost dimension (recursively), so that a box strided
// through a large fragment (one layer of a stack [emb, layers, mlp]) reads
// its rows, not everything between them: where the span is more than
// kSparseFactor times the bytes needed and each row is at least
// kSparseRowBytes, or the gaps between rows at least kSparseGapBytes, or the
// span more than kDenseFactor times the bytes needed (short rows with short
// gaps, such as a TP slice of a row, are cheaper read through than as one
// request each).
constexpr uint64_t kSparseFactor = 4, kDenseFactor = 16, kSparseRowBytes = 4096, kSparseGapBytes = 64ull << 10;

template <typename Fn>
Status EmitPiece(Piece& p, uint64_t esz, Fn& fn) {
  if (p.len.size() < 2) return fn(p);
  uint64_t needed = esz;
  for (int64_t l : p.len) needed *= static_cast<uint64_t>(l);
  Piece q;  // one index of the outermost dimension
  q.f = p.f;
  q.len.assign(p.len.begin() + 1, p.len.end());
  q.sstr.assign(p.sstr.begin() + 1, p.sstr.end());
  q.dstr.assign(p.dstr.begin() + 1, p.dstr.end());
  uint64_t span = 1;
  for (size_t d = 0; d < q.len.size(); ++d) span += static_cast<uint64_t>((q.len[d] - 1) * q.sstr[d]);
  q.span_bytes = span * esz;
  const uint64_t step = static_cast<uint64_t>(p.sstr[0]) * esz;
  if (p.span_bytes <= kSparseFactor * needed ||
      (q.span_bytes < kSparseRowBytes && step < q.span_bytes + kSparseGapBytes &&
       p.span_bytes <= kDenseFactor * needed)) {
    return fn(p);
  }
  for (int64_t i = 0; i < p.len[0]; ++i) {
    q.src_byte = p.src_byte + static_cast<uint64_t>(i * p.sstr[0]) * esz;
    q.dst_elem = p.dst_elem + static_cast<uint64_t>(i * p.dstr[0]);
    RETURN_IF_ERROR(EmitPiece(q, esz, fn));
  }
  return Status::Ok();
}

// Calls fn(piece) for each intersection of the view's elements [c0, c1)
// with a fragment (sparse ones cut, EmitPiece); checks each piece lies in its
// fragment's storage and that the fragments cover every element (a hole is
// an error, never zeros).
template <typename Fn>
Status VisitPieces(const Index& index, const TensorRecord& t, const std::vector<Fragment>& frags, const Box& view,
                   uint64_t e0, uint64_t c0, uint64_t c1, Fn&& fn) {
  const size_t rank = t.shape.size();
  const std::vector<int64_t> gstr = ContiguousStrides(view.lengths);
  uint64_t covered = 0;
  Piece p;
  std::vector<int64_t> lo(rank), hi(rank);
  for (Box b : DecomposeRange(view.lengths, c0, c1)) {
    for (size_t d = 0; d < rank; ++d) b.offsets[d] += view.offsets[d];
    for (const Fragment& f : frags) {
      bool empty = false;
      uint64_t count = 1;
      for (size_t d = 0; d < rank; ++d) {
        lo[d] = std::max(b.offsets[d], f.offsets[d]);
        hi[d] = std::min(b.offsets[d] + b.lengths[d], f.offsets[d] + f.lengths[d]);
        if (lo[d] >= hi[d])
          empty = true;
        else
          count *= static_cast<uint64_t>(hi[d] - lo[d]);
      }
      if (empty) continue;
      covered += count;
      int64_t src_elem = 0, dst_elem = -static_cast<int64_t>(e0);
      p.len.clear();
      p.sstr.clear();
      p.dstr.clear();
      for (size_t d = 0; d < rank; ++d) {
        src_elem += (lo[d] - f.offsets[d]) * f.strides[d];
        dst_elem += (lo[d] - view.offsets[d]) * gstr[d];
        if (hi[d] - lo[d] == 1) continue;
        int64_t l = hi[d] - lo[d];
        // Merge into the previous dim when it steps exactly over this one.
        if (!p.len.empty() && p.sstr.back() == f.strides[d] * l && p.dstr.back() == gstr[d] * l) {
          p.len.back() *= l;
          p.sstr.back() = f.strides[d];
          p.dstr.back() = gstr[d];
        } else {
          p.len.push_back(l);
          p.sstr.push_back(f.strides[d]);
          p.dstr.push_back(gstr[d]);
        }
      }
      const uint64_t esz = DTypeSize(f.dtype);
      uint64_t span = 1;
      for (size_t d = 0; d < p.len.size(); ++d) span += static_cast<uint64_t>((p.len[d] - 1) * p.sstr[d]);
      p.f = &f;
      p.src_byte = static_cast<uint64_t>(src_elem) * esz;
      p.span_bytes = span * esz;
      p.dst_elem = static_cast<uint64_t>(dst_elem);
      if (p.src_byte + p.span_bytes > f.data_length) {
        return Invalid("cannot read '" + t.key + "': fragment in " + index.files()[f.file.v].rel_path +
                       " is shorter than its shape (index corrupt?)");
      }
      RETURN_IF_ERROR(EmitPiece(p, esz, fn));
    }
  }
  if (covered != c1 - c0) {
    return Invalid("cannot read '" + t.key + "': " + std::to_string(c1 - c0 - covered) +
                   " requested elements are in no fragment (a hole in the checkpoint)");
  }
  return Status::Ok();
}

// Appends `sp`, joined to the last span when it continues it in the same file.
void AppendSpan(std::vector<SourceSpan>* spans, const SourceSpan& sp) {
  if (!spans->empty() && spans->back().file == sp.file && spans->back().offset + spans->back().length == sp.offset) {
    spans->back().length += sp.length;
  } else {
    spans->push_back(sp);
  }
}

}  // namespace

// Elements [c0, c1) of the view's C order (output offsets relative to
// element `e0`). `direct`: contiguous same-dtype pieces read straight into
// `base` instead of through staging and an op (the CPU's fast path; the GPU
// writes whole output ranges back and so stages everything).
Status TensorReader::PlanChunk(const TensorRecord& t, const std::vector<Fragment>& frags, const Box& view, DType out,
                               uint64_t e0, uint64_t c0, uint64_t c1, bool direct, char* base, Chunk* plan) {
  const uint64_t osz = DTypeSize(out);
  return VisitPieces(index_, t, frags, view, e0, c0, c1, [&](const Piece& p) -> Status {
    const Fragment& f = *p.f;
    const uint64_t dst_off = p.dst_elem * osz;
    const bool contiguous = p.len.size() <= 1 && (p.len.empty() || (p.sstr[0] == 1 && p.dstr[0] == 1));
    if (direct && contiguous && f.dtype == out && f.compression == Compression::kNone) {
      plan->files.insert(f.file.v);
      plan->reqs.push_back(IoRequest{fds_[f.file.v], f.data_offset + p.src_byte, p.span_bytes, base + dst_off});
      return Status::Ok();
    }
    // Staged: 16-byte aligned, so the GPU can use typed loads.
    plan->staging = (plan->staging + 15) & ~15ull;
    GatherOp op;
    op.src_off = plan->staging;
    op.dst_off = dst_off;
    op.sdtype = f.dtype;
    PushOp(op, p.len, p.sstr, p.dstr, 0, DTypeSize(f.dtype), osz, plan->ops);
    if (f.compression != Compression::kNone) {
      auto span = ItemSpan(f, f.data_offset + p.src_byte, p.span_bytes);
      if (!span.ok()) return span.status().Annotate("cannot read '" + t.key + "'");
      plan->items.push_back(Chunk::ItemCopy{span->first, span->second, p.span_bytes, plan->staging});
    } else {
      plan->files.insert(f.file.v);
      plan->staged.emplace_back(plan->reqs.size(), plan->staging);
      plan->reqs.push_back(IoRequest{fds_[f.file.v], f.data_offset + p.src_byte, p.span_bytes, nullptr});
    }
    plan->staging += p.span_bytes;
    return Status::Ok();
  });
}

// The rows of the elements that output bytes [offset, offset + len) of the
// view (`box`, null: the whole tensor) rendered at `osz` bytes each fall in,
// [*e0, e1), as (output element relative to *e0, source span), sorted by
// output element: false unless every piece is an uncompressed run of dtype
// `src`, contiguous in its innermost dimension, in at most `max_spans` rows,
// and the rows tile [*e0, e1) exactly (PlanCopy, PlanConvert).
bool TensorReader::CollectRuns(TensorId id, DType src, uint64_t osz, const Box* box, uint64_t offset, uint64_t len,
                               size_t max_spans, std::vector<std::pair<uint64_t, SourceSpan>>* runs, uint64_t* e0_out) {
  const TensorRecord& t = index_.tensors()[id.v];
  Box whole;
  auto view_or = ViewOf(t, box, &whole);
  if (osz == 0 || !view_or.ok()) return false;
  const Box& view = **view_or;
  if (offset + len > static_cast<uint64_t>(NumelOf(view.lengths)) * osz) return false;
  const auto frags_ptr = SpanFragments(id);
  if (frags_ptr == nullptr) return false;
  const std::vector<Fragment>& frags = *frags_ptr;
  const uint64_t e0 = offset / osz, e1 = (offset + len + osz - 1) / osz;
  *e0_out = e0;
  runs->clear();
  const uint64_t isz = DTypeSize(src);
  std::vector<int64_t> idx;
  Status s = VisitPieces(index_, t, frags, view, e0, e0, e1, [&](const Piece& p) -> Status {
    const Fragment& f = *p.f;
    const bool inner = p.len.empty() || (p.sstr.back() == 1 && p.dstr.back() == 1);
    if (f.dtype != src || f.compression != Compression::kNone || !inner)
      return Unsupported("not a run of source bytes");
    const size_t outer = p.len.empty() ? 0 : p.len.size() - 1;
    uint64_t rows = 1;
    for (size_t d = 0; d < outer; ++d) rows *= static_cast<uint64_t>(p.len[d]);
    if (runs->size() + rows > max_spans) return Unsupported("too many spans");
    const uint64_t run = p.len.empty() ? 1 : static_cast<uint64_t>(p.len.back());
    idx.assign(outer, 0);
    int64_t so = 0, dso = 0;  // element offsets of the current row
    for (uint64_t r = 0; r < rows; ++r) {
      runs->emplace_back(p.dst_elem + static_cast<uint64_t>(dso),
                         SourceSpan{f.file.v, f.data_offset + p.src_byte + static_cast<uint64_t>(so) * isz, run * isz});
      for (size_t d = outer; d-- > 0;) {  // next row: odometer over the outer dims
        so += p.sstr[d];
        dso += p.dstr[d];
        if (++idx[d] < p.len[d]) break;
        so -= p.sstr[d] * p.len[d];
        dso -= p.dstr[d] * p.len[d];
        idx[d] = 0;
      }
    }
    return Status::Ok();
  });
  if (!s.ok()) return false;
  std::sort(runs->begin(), runs->end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  uint64_t at = 0;
  for (const auto& [dst, sp] : *runs) {
    if (dst != at) return false;  // overlapping fragments: not a plain tiling
    at += sp.length / isz;
  }
  return at == e1 - e0;
}

bool TensorReader::PlanCopy(TensorId id, DType out, const Box* box, uint64_t offset, uint64_t len, size_t max_spans,
                            std::vector<SourceSpan>* spans) {
  spans->clear();
  if (id.v >= index_.tensors().size()) return false;
  const TensorRecord& t = index_.tensors()[id.v];
  // What is never a copy is declined before the fragments are looked up:
  // widened and narrowed reads ask first on every request.
  const bool bytes = t.encoding == Encoding::kBytes;
  if (!t.error.empty() || t.replicas > 1 || (!bytes && out != t.dtype)) return false;
  if (len == 0) return true;
  if (bytes) {
    const auto frags = SpanFragments(id);
    if (frags == nullptr) return false;
    const Fragment& f = (*frags)[0];
    if (frags->size() != 1 || f.compression != Compression::kNone || offset + len > f.data_length || max_spans == 0) {
      return false;
    }
    spans->push_back(SourceSpan{f.file.v, f.data_offset + offset, len});
    return true;
  }
  const uint64_t osz = DTypeSize(out);
  thread_local std::vector<std::pair<uint64_t, SourceSpan>> runs;
  uint64_t e0 = 0;
  if (!CollectRuns(id, out, osz, box, offset, len, max_spans, &runs, &e0)) return false;
  // The runs tile [0, (e1 - e0) * osz); keep [offset - e0 * osz, + len).
  const uint64_t head = offset - e0 * osz, tail = head + len;
  for (const auto& [elem, sp] : runs) {
    const uint64_t dst = elem * osz;
    const uint64_t lo = std::max(dst, head), hi = std::min(dst + sp.length, tail);
    if (lo < hi) AppendSpan(spans, SourceSpan{sp.file, sp.offset + (lo - dst), hi - lo});
  }
  return true;
}

bool TensorReader::PlanConvert(TensorId id, DType out, const Box* box, uint64_t offset, uint64_t len, size_t max_spans,
                               ConvertPlan* plan) {
  plan->spans.clear();
  if (id.v >= index_.tensors().size()) return false;
  const TensorRecord& t = index_.tensors()[id.v];
  if (!t.error.empty() || t.replicas > 1 || t.encoding == Encoding::kBytes || out == t.dtype ||
      !CanConvert(t.dtype, out) || len == 0 || DTypeSize(t.dtype) == 0) {
    return false;
  }
  const uint64_t osz = DTypeSize(out);
  thread_local std::vector<std::pair<uint64_t, SourceSpan>> runs;
  uint64_t e0 = 0;
  if (!CollectRuns(id, t.dtype, osz, box, offset, len, max_spans, &runs, &e0)) return false;
  for (const auto& [elem, sp] : runs) AppendSpan(&plan->spans, sp);
  plan->src = t.dtype;
  plan->out = out;
  plan->skip = offset - e0 * osz;
  plan->len = len;
  return true;
}

}  // namespace ckptfs

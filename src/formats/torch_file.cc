#include "formats/torch_file.h"

namespace ckptfs::formats {

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

std::string ShapeStr(const std::vector<int64_t>& s) {
  std::string o = "[";
  for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
}

int64_t FlatIndex(const std::vector<int64_t>& idx, const std::vector<int64_t>& strides) {
  int64_t f = 0;
  for (size_t d = 0; d < idx.size(); ++d) f += idx[d] * strides[d];
  return f;
}

std::vector<std::string> StrList(const PyValue* v) {
  std::vector<std::string> out;
  if (v == nullptr || !v->IsSeq()) return out;
  for (PyRef x : v->items) {
    if (x->IsStr()) out.push_back(x->s);
  }
  return out;
}

std::unique_ptr<Source> Files::Open(const std::string& rel, bool parse) {
  auto s = std::make_unique<Source>();
  s->rel = rel;
  s->file = FileId{static_cast<uint32_t>(ck->files.size())};
  ck->files.push_back(SourceFile{rel, 0, 0, 0});
  auto fd = OpenAndFingerprint(dir, ck->files.back());
  if (!fd.ok()) {
    s->error = fd.status().message();
    return s;
  }
  s->fd = *fd;
  if (!parse) return s;
  s->reader = std::make_unique<FileSliceReader>(s->fd, 0, ck->files[s->file.v].size, rel);
  auto a = ReadTorchSave(*s->reader, pickle);
  if (!a.ok()) {
    s->error = "cannot parse " + rel + ": " + a.status().message();
  } else {
    s->archive = std::move(a).value();
  }
  return s;
}

Result<Loc> Resolve(const Source& s, const PyValue* v, const std::string& what) {
  if (v == nullptr || v->kind != PyKind::kTensor) return Invalid(s.rel + ": " + what + " is not a tensor");
  ASSIGN_OR_RETURN(ResolvedTensor rt, ResolveTensor(*s.reader, s.archive, v->tensor));
  Loc l;
  l.dtype = v->tensor.dtype;
  l.shape = v->tensor.shape;
  l.strides = v->tensor.strides;
  l.data_offset = rt.data_offset;
  l.data_length = rt.data_length;
  return l;
}

}  // namespace ckptfs::formats

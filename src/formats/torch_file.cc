#include "formats/torch_file.h"

namespace ckptfs::formats {

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
    std::vector<ChecksumRange> sums;
    AppendZipChecksums(*s->reader, s->archive, s->file, 0, &sums);
    for (const ChecksumRange& c : sums) ck->checksums.Add(c);
    for (const std::string& g : s->archive.placeholders) {
      Seen& seen = placeholders_[g];
      if (seen.files++ == 0) seen.first = rel;
    }
  }
  return s;
}

std::string Files::PlaceholderNote() const {
  if (placeholders_.empty()) return "";
  std::string out = "unknown pickle globals kept as inert placeholders (metadata that decides no tensor bytes): ";
  size_t i = 0;
  for (const auto& [g, seen] : placeholders_) {
    if (i++ == 8) {
      out += ", and " + std::to_string(placeholders_.size() - 8) + " more";
      break;
    }
    out += (i > 1 ? ", " : "") + g + " (" + std::to_string(seen.files) + " file" + (seen.files > 1 ? "s" : "") +
           ", first " + seen.first + ")";
  }
  return out;
}

Result<Loc> Resolve(const Source& s, const PyValue* v, const std::string& what) {
  if (v == nullptr || v->kind != PyKind::kTensor) return Invalid(s.rel + ": " + what + " is not a tensor");
  ASSIGN_OR_RETURN(ResolvedTensor rt, ResolveTensor(*s.reader, s.archive, v->tensor()));
  Loc l;
  l.dtype = v->tensor().dtype;
  l.shape = v->tensor().shape;
  l.strides = v->tensor().strides;
  l.data_offset = rt.data_offset;
  l.data_length = rt.data_length;
  return l;
}

Fragment WholeFragment(const Loc& l, FileId file) {
  Fragment f;
  f.file = file;
  f.dtype = l.dtype;
  f.offsets.assign(l.shape.size(), 0);
  f.lengths = l.shape;
  f.strides = l.strides;
  f.data_offset = l.data_offset;
  f.data_length = l.data_length;
  return f;
}

}  // namespace ckptfs::formats
